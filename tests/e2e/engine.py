"""A real vLLM engine in its own process, driven over a pipe (JSON lines).

``EngineProcess.start(model_dir, work_dir, extra_config=...)`` runs this file as a
script with an in-process ``LLM`` (VLLM_ENABLE_V1_MULTIPROCESSING=0:
starts in seconds) and the kvtier connector when ``extra_config`` is given. Each
process is "another machine" to the others: they share only the tier.

Images travel as recipes (``{"seed": n, "size": [w, h]}``, ``"png": true`` to hand
vLLM the PNG file as its server does), drawn in the engine process, so the parent
needs no image library.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0
CALL_TIMEOUT_S = 120.0


@dataclass
class Output:
    token_ids: list[int]
    num_cached_tokens: int
    num_prompt_tokens: int


class EngineError(RuntimeError):
    pass


class EngineProcess:
    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log = log

    @classmethod
    def start(
        cls,
        model: Path,
        work_dir: Path,
        *,
        extra_config: dict[str, Any] | None = None,
        kv_role: str = "kv_both",
        multimodal: bool = False,
        name: str = "engine",
        wait: bool = True,
        ec_extra_config: dict[str, Any] | None = None,
        ec_role: str = "ec_both",
        limit_mm_per_prompt: dict[str, int] | None = None,
        llm_kwargs: dict[str, Any] | None = None,
    ) -> EngineProcess:
        """``ec_extra_config``: also (or only) the encoder-cache connector
        (``kvtier.connector.ec``) with this ``ec_connector_extra_config``.
        ``llm_kwargs``: more (or other) arguments for vLLM's ``LLM`` (engine args)."""
        work_dir.mkdir(parents=True, exist_ok=True)
        spec = {
            "model": str(model),
            "extra_config": extra_config,
            "kv_role": kv_role,
            "multimodal": multimodal,
            "ec_extra_config": ec_extra_config,
            "ec_role": ec_role,
            "limit_mm_per_prompt": limit_mm_per_prompt,
            "llm_kwargs": llm_kwargs or {},
        }
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CACHE_ROOT": str(work_dir.parent / "vllm-cache"),
            "TMPDIR": str(work_dir),
            "VLLM_LOGGING_LEVEL": "INFO",
            "TOKENIZERS_PARALLELISM": "false",
        }
        log = work_dir / f"{name}.log"
        with log.open("a") as err:
            proc = subprocess.Popen(
                # -P: the checkout's operator/ must not shadow the standard library's.
                [sys.executable, "-P", __file__, json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=work_dir,
                env=env,
            )
        engine = cls(proc, log)
        if wait:
            engine.wait_ready()
        return engine

    def wait_ready(self) -> None:
        """Block until the engine has started (``start(..., wait=False)`` returns at once,
        so several engines can start side by side)."""
        self._reply(START_TIMEOUT_S)

    def generate(self, prompts: list[dict[str, Any]], max_tokens: int = 16) -> list[Output]:
        reply = self.call({"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens})
        return [Output(**o) for o in reply]

    def call(self, message: dict[str, Any], timeout_s: float = CALL_TIMEOUT_S) -> Any:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as exc:
            raise EngineError(f"engine died:\n{self._tail()}") from exc
        return self._reply(timeout_s)

    def stats(self) -> dict[str, float]:
        """The connector's counters since start (worker and scheduler halves)."""
        result: dict[str, float] = self.call({"cmd": "stats"})
        return result

    def tokenize(self, prompt: str) -> list[int]:
        result: list[int] = self.call({"cmd": "tokenize", "prompt": prompt})
        return result

    def chunk_keys(self, prompt: str) -> list[bytes]:
        """The chunk keys (rank 0) the connector computes for a text prompt."""
        return [bytes.fromhex(k) for k in self.call({"cmd": "chunk_keys", "prompt": prompt})]

    def ec_stats(self) -> dict[str, float]:
        """The encoder-cache connector's counters since start (both halves)."""
        result: dict[str, float] = self.call({"cmd": "ec_stats"})
        return result

    def encoder_calls(self) -> int:
        """Forward calls of the model's multimodal encoder (vision or audio tower) so far."""
        return int(self.call({"cmd": "encoder_calls"}))

    def encoder_seconds(self) -> float:
        """Seconds spent in the model's multimodal encoder so far (forward calls)."""
        return float(self.call({"cmd": "encoder_seconds"}))

    def ec_flush(self) -> None:
        """Wait until the encoder-cache connector's background sender has sent its queue."""
        self.call({"cmd": "ec_flush"})

    def flush(self) -> None:
        """Wait until the connector's background sender has sent what it queued."""
        if not self.call({"cmd": "flush"}):
            raise EngineError(f"the connector's sender did not drain in 30s:\n{self._tail()}")

    def _reply(self, timeout_s: float) -> Any:
        out = self.proc.stdout
        assert out is not None
        line = _readline(out, self.proc, timeout_s)
        if line is None:
            self.kill()
            raise EngineError(f"engine gave no answer in {timeout_s:.0f}s:\n{self._tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise EngineError(f"{reply['error']}\n{self._tail()}")
        return reply["result"]

    def _tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])

    def close(self) -> None:
        self.begin_close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.proc.stdout is not None:
            with contextlib.suppress(OSError):
                self.proc.stdout.close()

    def begin_close(self) -> None:
        """Ask the engine to exit (closing its input) without waiting for it."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _readline(out: IO[str], proc: subprocess.Popen[str], timeout_s: float) -> str | None:
    import selectors

    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(out, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.5):
                line = out.readline()
                return line or None
            if proc.poll() is not None:
                return None
    return None


# -- the engine process ------------------------------------------------------------------


def _image(recipe: dict[str, Any]) -> Any:
    import numpy as np
    from PIL import Image

    width, height = recipe.get("size", (224, 224))
    rng = np.random.default_rng(recipe["seed"])
    picture = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    if not recipe.get("png"):
        return picture
    # As vLLM's server loads an uploaded PNG: its mm hash is over the file's bytes.
    import io

    from vllm.multimodal.media.image import ImageMediaIO

    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    return ImageMediaIO(image_mode="RGB").load_bytes(buf.getvalue())


def _connector_stats() -> dict[str, float]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {}
    worker = get_kv_transfer_group()
    totals: dict[str, float] = worker.recorder.totals()
    for key, value in _scheduler_connector().recorder.totals().items():
        totals[key] = totals.get(key, 0) + value
    return totals


def _audio(recipe: dict[str, Any]) -> Any:
    import numpy as np

    rng = np.random.default_rng(recipe["seed"])
    rate = 16000  # other rates need torchaudio to resample (absent here)
    return (rng.uniform(-0.5, 0.5, int(rate * recipe.get("seconds", 1.0))).astype(np.float32), rate)


def _ec_stats() -> dict[str, float]:
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

    if not has_ec_transfer():
        return {}
    totals: dict[str, float] = get_ec_transfer().recorder.totals()  # type: ignore[attr-defined]
    scheduler = _LLM.llm_engine.engine_core.engine_core.scheduler.ec_connector
    for key, value in scheduler.recorder.totals().items():
        totals[key] = totals.get(key, 0) + value
    return totals


# The encoder's attribute path on vLLM's model, per architecture (Idefics3 nests its ViT).
ENCODER_MODULES = ("visual", "vision_tower", "audio_tower", "model.vision_model")
_ENCODER_CALLS = [0]
_ENCODER_SECONDS = [0.0, 0.0]  # total, start of the running call


def _count_encoder_calls() -> None:
    """Forward hooks on the model's encoder: prove whether an engine ran it, and time it."""
    runner = _LLM.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    model = runner.model_runner.get_model()
    for path in ENCODER_MODULES:
        module = model
        for name in path.split("."):
            module = getattr(module, name, None)
        if module is not None:

            def before(*_: Any) -> None:
                _ENCODER_SECONDS[1] = time.perf_counter()

            def hook(*_: Any) -> None:
                _ENCODER_CALLS[0] += 1
                _ENCODER_SECONDS[0] += time.perf_counter() - _ENCODER_SECONDS[1]

            module.register_forward_pre_hook(before)
            module.register_forward_hook(hook)
            return


_LLM: Any = None


def _scheduler_connector() -> Any:
    return _LLM.llm_engine.engine_core.engine_core.scheduler.connector


def _serve(spec: dict[str, Any]) -> None:
    global _LLM
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's prints and logs go to the log file, replies to the parent

    def reply(**message: Any) -> None:
        proto.write(json.dumps(message) + "\n")
        proto.flush()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "max_model_len": 4096,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "seed": 0,
        "dtype": "bfloat16",
    }
    if spec["multimodal"]:
        kwargs["limit_mm_per_prompt"] = spec.get("limit_mm_per_prompt") or {"image": 2, "video": 0}
    kwargs.update(spec.get("llm_kwargs") or {})
    if spec.get("ec_extra_config") is not None:
        from vllm.config import ECTransferConfig

        kwargs["ec_transfer_config"] = ECTransferConfig(
            ec_connector="KvtierECConnector",
            ec_connector_module_path="kvtier.connector.ec",
            ec_role=spec["ec_role"],
            ec_connector_extra_config=spec["ec_extra_config"],
        )
    if spec["extra_config"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector",
            kv_connector_module_path="kvtier.connector.vllm",
            kv_role=spec["kv_role"],
            kv_connector_extra_config=spec["extra_config"],
        )
    _LLM = LLM(**kwargs)
    if spec["multimodal"]:
        _count_encoder_calls()
    reply(result="ready")
    for line in sys.stdin:
        message = json.loads(line)
        try:
            cmd = message["cmd"]
            if cmd == "generate":
                params = SamplingParams(max_tokens=message["max_tokens"], temperature=0.0)
                prompts = []
                for p in message["prompts"]:
                    prompt: dict[str, Any] = (
                        {"prompt_token_ids": p["prompt_token_ids"]}
                        if "prompt_token_ids" in p
                        else {"prompt": p["prompt"]}
                    )
                    if p.get("cache_salt"):
                        prompt["cache_salt"] = p["cache_salt"]
                    if p.get("images"):
                        prompt["multi_modal_data"] = {"image": [_image(i) for i in p["images"]]}
                    if p.get("audios"):
                        prompt.setdefault("multi_modal_data", {})["audio"] = [
                            _audio(a) for a in p["audios"]
                        ]
                    prompts.append(prompt)
                outputs = _LLM.generate(prompts, params, use_tqdm=False)
                reply(
                    result=[
                        {
                            "token_ids": list(o.outputs[0].token_ids),
                            "num_cached_tokens": int(o.num_cached_tokens or 0),
                            "num_prompt_tokens": len(o.prompt_token_ids or ()),
                        }
                        for o in outputs
                    ]
                )
            elif cmd == "tokenize":
                reply(result=_LLM.get_tokenizer().encode(message["prompt"]))
            elif cmd == "chunk_keys":
                # The keys the connector computes for a text prompt (rank 0), in hex.
                from types import SimpleNamespace

                ids = message.get("prompt_token_ids") or _LLM.get_tokenizer().encode(
                    message["prompt"]
                )
                request = SimpleNamespace(prompt_token_ids=ids, mm_features=[], cache_salt=None)
                keys = _scheduler_connector().scheduler._keys(request)
                reply(result=[k[0].hex() for k in keys])
            elif cmd == "stats":
                reply(result=_connector_stats())
            elif cmd == "ec_stats":
                reply(result=_ec_stats())
            elif cmd == "encoder_calls":
                reply(result=_ENCODER_CALLS[0])
            elif cmd == "encoder_seconds":
                reply(result=_ENCODER_SECONDS[0])
            elif cmd == "ec_flush":
                from vllm.distributed.ec_transfer import get_ec_transfer

                sender = get_ec_transfer().worker.sender  # type: ignore[attr-defined]
                reply(result=sender.flush(30.0))
            elif cmd == "flush":
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                reply(result=get_kv_transfer_group().worker.sender.flush(30.0))
            else:
                reply(error=f"unknown command {cmd!r}")
        except Exception as exc:
            import traceback

            traceback.print_exc()
            reply(error=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
