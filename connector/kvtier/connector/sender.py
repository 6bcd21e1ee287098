"""The background sender of both connectors: saves to the tier off the engine's thread.

The engine thread only copies a chunk (a KV chunk, an encoder output) out of its
cache and ``offer``s it (its encoded frames, or a function that encodes them: then
the sender thread does the encoding, e.g. compression); a daemon thread sends
batches with ``Put``, and the deletes of entries that failed verification. The
queue is bounded: when it is full (tier slow or down) new chunks are dropped and
counted, never waited for. While the circuit breaker is open, dequeued batches are
dropped too (``tier_down``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from typing_extensions import Buffer

from kvtier.connector.client.breaker import CircuitBreaker
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.errors import NonFiniteChunk, TierError
from kvtier.connector.metrics import Recorder
from kvtier.connector.tiercalls import PutTier

logger = logging.getLogger(__name__)


Parts = Sequence[Buffer]
Encode = Callable[[], list[Buffer]]


@dataclass(frozen=True)
class _Save:
    key: bytes
    parts: Parts | Encode
    nbytes: int


@dataclass(frozen=True)
class _Delete:
    key: bytes


class SaveSender:
    def __init__(
        self,
        tier: PutTier,
        *,
        capacity: int,
        batch: int,
        timeout_s: float,
        breaker: CircuitBreaker,
        recorder: Recorder,
    ) -> None:
        self._tier = tier
        self._batch = batch
        self._timeout_s = timeout_s
        self._breaker = breaker
        self._recorder = recorder
        self._queue: queue.Queue[_Save | _Delete] = queue.Queue(maxsize=capacity)
        self._stop = threading.Event()
        # Jobs queued and jobs finished (sent or dropped), both in queue order: flush()
        # waits until the jobs queued before it are finished. Counted under the condition,
        # so a job offered while the sender finishes a batch never looks sent.
        self._queued = 0
        self._finished_jobs = 0
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvtier-sender", daemon=True)
        self._thread.start()

    @classmethod
    def for_saves(
        cls,
        tier: PutTier,
        config: ConnectorConfig,
        *,
        breaker: CircuitBreaker,
        recorder: Recorder,
        per_chunk: int = 1,
    ) -> SaveSender:
        """The sender of a connector worker's saves (``save_queue_chunks``,
        ``save_batch_chunks``, ``save_timeout_s``); the KV and encoder-cache workers
        both use it. ``per_chunk``: the entries one chunk is stored as (one per KV cache
        group): the queue and the batches count chunks, not entries."""
        return cls(
            tier,
            capacity=config.save_queue_chunks * per_chunk,
            batch=config.save_batch_chunks * per_chunk,
            timeout_s=config.save_timeout_s,
            breaker=breaker,
            recorder=recorder,
        )

    def has_room(self) -> bool:
        return not self._queue.full()

    def room(self) -> int:
        """How many more chunks the queue takes now."""
        return max(0, self._queue.maxsize - self._queue.qsize())

    def offer(self, key: bytes, parts: Parts | Encode, nbytes: int) -> bool:
        """Queue a chunk for saving; False (and counted) when the queue is full.

        ``parts``: the encoded frames (``nbytes`` in all), or a function returning them,
        called on the sender thread (``nbytes`` is then measured there)."""
        if not self._enqueue(_Save(key, parts, nbytes)):
            self._recorder.count("saves_dropped", label="queue_full")
            return False
        return True

    def delete(self, key: bytes) -> None:
        """Best-effort removal of a chunk that failed verification."""
        self._enqueue(_Delete(key))

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued so far was sent or dropped (tests, shutdown)."""
        with self._done:
            target = self._queued
            return self._done.wait_for(lambda: self._finished_jobs >= target, timeout_s)

    def _enqueue(self, job: _Save | _Delete) -> bool:
        with self._done:
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                return False
            self._queued += 1
        return True

    def _finished(self, jobs: int) -> None:
        with self._done:
            self._finished_jobs += jobs
            self._done.notify_all()

    def close(self, timeout_s: float = 2.0) -> None:
        self.flush(timeout_s)
        self._stop.set()
        self._thread.join(timeout_s)

    # -- the sender thread -----------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            jobs = [first]
            while len(jobs) < self._batch:
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._send([j for j in jobs if isinstance(j, _Save)])
                self._delete([j.key for j in jobs if isinstance(j, _Delete)])
            except Exception:
                logger.exception("kvtier: the background sender failed a batch")
            finally:
                self._finished(len(jobs))

    def _send(self, saves: list[_Save]) -> None:
        ready = [encoded for save in saves if (encoded := self._encoded(save)) is not None]
        if not ready:
            return
        if not self._breaker.allow():
            self._recorder.count("saves_dropped", len(ready), label="tier_down")
            return
        started = time.perf_counter()
        try:
            self._tier.put([(key, parts) for key, parts, _ in ready], timeout_s=self._timeout_s)
        except TierError as exc:
            self._breaker.failure()
            self._recorder.count("errors", label="save")
            self._recorder.count("saves_dropped", len(ready), label="tier_down")
            logger.warning("kvtier: Put of %d chunk(s) failed (%s)", len(ready), exc)
            return
        self._breaker.success()
        self._recorder.observe("save_seconds", time.perf_counter() - started)
        self._recorder.count("saved_chunks", len(ready))
        self._recorder.count("saved_bytes", sum(nbytes for _, _, nbytes in ready))

    def _encoded(self, save: _Save) -> tuple[bytes, Parts, int] | None:
        """``(key, frames, bytes)`` of a save, encoding it now if it came as a function."""
        if not callable(save.parts):
            return save.key, save.parts, save.nbytes
        try:
            parts = save.parts()
        except NonFiniteChunk as exc:
            refuse_nonfinite(self._recorder, exc)
            return None
        except Exception:
            logger.exception("kvtier: encoding a chunk for the tier failed")
            self._recorder.count("errors", label="save")
            return None
        return save.key, parts, sum(memoryview(p).nbytes for p in parts)

    def _delete(self, keys: list[bytes]) -> None:
        if not keys or not self._breaker.allow():
            return
        try:
            self._tier.delete(keys, timeout_s=self._timeout_s)
        except TierError as exc:
            self._breaker.failure()
            self._recorder.count("errors", label="delete")
            logger.warning("kvtier: Delete failed (%s)", exc)
            return
        self._breaker.success()


_NONFINITE_LOG_EVERY_S = 60.0
_nonfinite_logged: dict[str, tuple[float, int]] = {}
"""Per series (KV chunks, encoder outputs): when ``refuse_nonfinite`` last logged, and
the refusals since."""
_nonfinite_lock = threading.Lock()


def refuse_nonfinite(recorder: Recorder, exc: NonFiniteChunk) -> None:
    """A chunk not stored because it holds a NaN or an infinity: counted in
    ``saves_dropped{reason="nonfinite"}``, and logged at most once a minute per process and
    series (an engine whose KV went bad refuses every chunk it computes)."""
    recorder.count("saves_dropped", label="nonfinite")
    what = recorder.series.prefix
    with _nonfinite_lock:
        last, refused = _nonfinite_logged.get(what, (0.0, 0))
        now = time.monotonic()
        if last and now - last < _NONFINITE_LOG_EVERY_S:
            _nonfinite_logged[what] = (last, refused + 1)
            return
        _nonfinite_logged[what] = (now, 0)
    logger.warning(
        "kvtier: not storing a value that holds a NaN or an infinity (%s; %s): this "
        "engine's model or KV cache produced non-finite values, and sharing them would "
        "spread wrong output to every engine that loads them",
        exc, f"{refused} more refused since the last such warning" if last else "the first",
    )  # fmt: skip
