"""A real vLLM engine in its own process, driven over a pipe (JSON lines): the one
engine harness of the tests and the benchmarks (``kvtier bench e2e``, ``kvtier bench ec``).

``EngineProcess.start(model_dir, work_dir, extra_config=...)`` runs
``kvtier.testing.engine_serve`` in a new process, with an in-process ``LLM`` (VLLM_ENABLE_V1_MULTIPROCESSING=0:
starts in seconds) and the kvtier connector when ``extra_config`` is given (the
encoder-cache connector with ``ec_extra_config``; other engine arguments, e.g. vLLM's
own offloading, with ``llm_kwargs``). Each process is "another machine" to the
others: they share only the tier. An engine that fails to start answers with the
exception (its type and message): ``EngineError``, whose first line is that answer.

``generate`` runs prompts as a batch; ``measure`` runs one prompt with
``max_tokens=1`` timed inside the engine process (pre-processing, encoder, prefill
and one token: its time to first token, without the pipe), then waits for the
connector's background saves, timed apart, so they never overlap the next request.

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

START_TIMEOUT_S = 240.0
CALL_TIMEOUT_S = 120.0


@dataclass
class Output:
    token_ids: list[int]
    num_cached_tokens: int
    num_prompt_tokens: int


@dataclass(frozen=True)
class Measurement:
    """One prompt run by ``measure``."""

    ttft_s: float
    """Seconds from the request to its first token, inside the engine process."""
    save_wait_s: float
    """Seconds then spent waiting for the connector's background saves (0 without kvtier)."""
    token: int
    cached_tokens: int
    prompt_tokens: int


class EngineError(RuntimeError):
    pass


class EngineProcess:
    def __init__(
        self, proc: subprocess.Popen[str], log: Path, call_timeout_s: float = CALL_TIMEOUT_S
    ) -> None:
        self.proc = proc
        self.log = log
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = START_TIMEOUT_S

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
        env: dict[str, str] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> EngineProcess:
        """``ec_extra_config``: also (or only) the encoder-cache connector
        (``kvtier.connector.ec``) with this ``ec_connector_extra_config``.
        ``llm_kwargs``: more (or other) arguments for vLLM's ``LLM`` (engine args).
        ``env``: more (or other) environment variables of the engine process."""
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
            **(env or {}),
        }
        log = work_dir / f"{name}.log"
        with log.open("a") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.testing.engine_serve", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=work_dir,
                env=env,
            )
        engine = cls(proc, log, call_timeout_s)
        engine.start_timeout_s = start_timeout_s
        if wait:
            engine.wait_ready()
        return engine

    def wait_ready(self) -> None:
        """Block until the engine has started (``start(..., wait=False)`` returns at once,
        so several engines can start side by side); ``EngineError`` if it did not."""
        try:
            self._reply(self.start_timeout_s)
        except EngineError:
            self.close()
            raise

    def generate(self, prompts: list[dict[str, Any]], max_tokens: int = 16) -> list[Output]:
        reply = self.call({"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens})
        return [Output(**o) for o in reply]

    def measure(self, prompt: dict[str, Any]) -> Measurement:
        """One prompt with ``max_tokens=1``, timed in the engine process (module doc)."""
        return Measurement(**self.call({"cmd": "measure", "prompt": prompt}))

    def call(self, message: dict[str, Any], timeout_s: float | None = None) -> Any:
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
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

    def kv_cache_groups(self) -> dict[str, Any]:
        """The engine's KV cache groups (``spec``, ``layers``, ``sliding_window``,
        ``block_size``, ``page_bytes``), ``num_blocks`` and ``hybrid_manager`` (whether
        vLLM's hybrid KV cache manager is on), from the engine's own scheduler."""
        result: dict[str, Any] = self.call({"cmd": "kv_cache_groups"})
        return result

    def kv_blocks(self, prompt: dict[str, Any], max_tokens: int = 4) -> dict[str, list[int]]:
        """Run ``prompt`` alone and return, per KV cache group, the blocks vLLM's KV cache
        manager held for it: ``peak`` (any step), ``last`` (its last step) and
        ``block_bytes`` (bytes of one block of the group: page size x layers)."""
        result: dict[str, list[int]] = self.call(
            {"cmd": "kv_blocks", "prompt": prompt, "max_tokens": max_tokens}
        )
        return result

    def kv_nonfinite(self) -> dict[str, Any]:
        """Blocks of the engine's KV cache holding a NaN or an infinity: ``blocks`` (how
        many were scanned) and ``found`` (up to 20 ``[tensor, block]``)."""
        result: dict[str, Any] = self.call({"cmd": "kv_nonfinite"})
        return result

    def last_chunk_keys(self, group: int = 0) -> list[bytes]:
        """The chunk keys (rank 0, KV cache group ``group`` of ``kv_cache_groups()``) of
        the last request this engine's connector keyed, as stored in the tier (multimodal
        spans substituted)."""
        return [bytes.fromhex(k) for k in self.call({"cmd": "last_chunk_keys", "group": group})]

    def receive_buffers(self) -> dict[str, int]:
        """The worker's tier client's receive buffers: ``reused`` (Get values received into
        a buffer given back by an earlier load) and ``bytes`` (kept now)."""
        result: dict[str, int] = self.call({"cmd": "receive_buffers"})
        return result

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
