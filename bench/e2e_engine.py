"""One vLLM engine of ``kvtier bench e2e``, in its own process, driven over a pipe.

``Engine.start(spec, work_dir)`` runs this file as a script: an in-process ``LLM``
(VLLM_ENABLE_V1_MULTIPROCESSING=0) built from ``spec["llm"]`` (keyword arguments of
``vllm.LLM``), with the kvtier connector when ``spec["kvtier"]`` holds its
``kv_connector_extra_config``. Each request is timed inside the engine process
(``generate`` with ``max_tokens=1``: pre-processing, encoder, prefill and one token),
so the pipe is not in the numbers. An engine that fails to start answers with the
exception (its type and message), which the benchmark reports as the arm's result.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 900.0


class EngineFailed(RuntimeError):
    """The engine did not start, died, or answered a call with an error."""


class Engine:
    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log = log

    @classmethod
    def start(cls, spec: dict[str, Any], work_dir: Path, name: str, env: dict[str, str]) -> Engine:
        work_dir.mkdir(parents=True, exist_ok=True)
        log = work_dir / f"{name}.log"
        full_env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CACHE_ROOT": str(work_dir.parent / "vllm-cache"),
            "TMPDIR": str(work_dir),
            "TOKENIZERS_PARALLELISM": "false",
            **env,
        }
        with log.open("a") as err:
            proc = subprocess.Popen(
                # -P: the checkout's operator/ must not shadow the standard library's.
                [sys.executable, "-P", __file__, json.dumps(spec)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                text=True, cwd=work_dir, env=full_env,
            )  # fmt: skip
        engine = cls(proc, log)
        try:
            engine._reply(START_TIMEOUT_S)
        except EngineFailed:
            engine.close()
            raise
        return engine

    def call(self, message: dict[str, Any], timeout_s: float = CALL_TIMEOUT_S) -> Any:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as exc:
            raise EngineFailed(f"engine died:\n{self.tail()}") from exc
        return self._reply(timeout_s)

    def _reply(self, timeout_s: float) -> Any:
        out = self.proc.stdout
        assert out is not None
        line = None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(out, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(timeout=0.5):
                    line = out.readline() or None
                    break
                if self.proc.poll() is not None:
                    break
        if line is None:
            self.kill()
            raise EngineFailed(f"engine gave no answer within {timeout_s:.0f}s:\n{self.tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise EngineFailed(reply["error"])
        return reply["result"]

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.proc.stdout is not None:
            with contextlib.suppress(OSError):
                self.proc.stdout.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# -- the engine process ------------------------------------------------------------------


def _image(recipe: dict[str, Any]) -> Any:
    import numpy as np
    from PIL import Image

    width, height = recipe["size"]
    rng = np.random.default_rng(recipe["seed"])
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _serve(spec: dict[str, Any]) -> None:
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's prints and logs go to the log file, replies to the parent

    def reply(**message: Any) -> None:
        proto.write(json.dumps(message) + "\n")
        proto.flush()

    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        kwargs = dict(spec["llm"])
        if spec.get("kvtier") is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector="KvtierConnector",
                kv_connector_module_path="kvtier.connector.vllm",
                kv_role="kv_both",
                kv_connector_extra_config=spec["kvtier"],
            )
        llm = LLM(**kwargs)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        reply(error=f"{type(exc).__name__}: {exc}")
        return
    reply(result="ready")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for line in sys.stdin:
        message = json.loads(line)
        try:
            cmd = message["cmd"]
            if cmd == "generate":
                p = message["prompt"]
                prompt: dict[str, Any] = (
                    {"prompt_token_ids": p["prompt_token_ids"]}
                    if "prompt_token_ids" in p
                    else {"prompt": p["prompt"]}
                )
                if p.get("images"):
                    prompt["multi_modal_data"] = {"image": [_image(i) for i in p["images"]]}
                started = time.perf_counter()
                (out,) = llm.generate([prompt], params, use_tqdm=False)
                ttft = time.perf_counter() - started
                flush_s = 0.0
                if spec.get("kvtier") is not None:
                    # Saves run in the background; wait for them here (timed apart), so
                    # they never overlap the next request's prefill on a small machine.
                    from vllm.distributed.kv_transfer import get_kv_transfer_group

                    started = time.perf_counter()
                    get_kv_transfer_group().worker.sender.flush(120.0)
                    flush_s = time.perf_counter() - started
                reply(
                    result={
                        "ttft_s": ttft,
                        "save_wait_s": flush_s,
                        "token": out.outputs[0].token_ids[0],
                        "cached_tokens": int(out.num_cached_tokens or 0),
                        "prompt_tokens": len(out.prompt_token_ids or ()),
                    }
                )
            elif cmd == "stats":
                reply(result=_connector_stats(llm))
            else:
                reply(error=f"unknown command {cmd!r}")
        except Exception as exc:
            import traceback

            traceback.print_exc()
            reply(error=f"{type(exc).__name__}: {exc}")


def _connector_stats(llm: Any) -> dict[str, float]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group() or not hasattr(get_kv_transfer_group(), "recorder"):
        return {}  # no connector, or one of vLLM's own (no kvtier counters)
    totals: dict[str, float] = dict(get_kv_transfer_group().recorder.totals())
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    for key, value in scheduler.recorder.totals().items():
        totals[key] = totals.get(key, 0) + value
    return totals


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
