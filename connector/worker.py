"""The worker half: chunks into KV blocks before the forward pass, and out after it.

A chunk's payload is its blocks of every attention layer, stacked:
``[num_layers, *kv_layer.index_select(block_dim, chunk_blocks).shape]``. On the CPU
backend a layer is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, so a
chunk is ``[layers, blocks_per_chunk, kv_heads, block_size, 2 * head_size]``.

Loads are synchronous (``start_load_kv`` runs before the forward pass that needs
them), bounded by ``load_timeout_s``. Every chunk is verified (``decode_chunk``:
key fingerprint, length, checksum; then dtype and shape); a chunk that is missing,
late, corrupt or of another shape fails itself and every later chunk of its
request, and their blocks are reported through ``failed_blocks()`` so vLLM
recomputes them. Saves copy the chunk out of the KV cache (a memcpy) and hand it
to the background sender, which also compresses them when ``codec`` is not ``raw``
(so compression never runs on the engine's thread).
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Iterable, MutableSequence, Sequence
from typing import Protocol

import torch

from kvtier.connector.breaker import CircuitBreaker
from kvtier.connector.codec import decode_chunk, encode_chunk
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.errors import ChunkDecodeError, ConfigError, TierError
from kvtier.connector.metadata import ChunkLoad, RequestLoad, StepPlan
from kvtier.connector.metrics import Recorder
from kvtier.connector.sender import PutTier, SaveSender

logger = logging.getLogger(__name__)


class GetTier(PutTier, Protocol):
    def get(
        self,
        keys: Sequence[bytes],
        *,
        stop_at_first_miss: bool = True,
        timeout_s: float | None = None,
    ) -> Sequence[bytes | memoryview | None]: ...

    def recycle(self, values: MutableSequence[bytes | memoryview | None]) -> int: ...


class KvtierWorker:
    def __init__(
        self,
        config: ConnectorConfig,
        tier: GetTier,
        *,
        rank: int,
        num_blocks: int,
        layer_order: Sequence[str],
        breaker: CircuitBreaker,
        recorder: Recorder,
    ) -> None:
        self._config = config
        self._tier = tier
        self._rank = rank
        self._num_blocks = num_blocks
        self._layer_order = list(layer_order)
        self._breaker = breaker
        self._recorder = recorder
        self._layers: list[torch.Tensor] = []
        self._block_dim = 0
        self._dtype = ""
        self._failed: set[int] = set()
        self._sender = SaveSender(
            tier,
            capacity=config.save_queue_chunks,
            batch=config.save_batch_chunks,
            timeout_s=config.save_timeout_s,
            breaker=breaker,
            recorder=recorder,
        )

    @property
    def sender(self) -> SaveSender:
        return self._sender

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = [n for n in self._layer_order if n in kv_caches] or list(kv_caches)
        layers = [kv_caches[n] for n in names]
        first = layers[0]
        if first.shape[0] == self._num_blocks:
            block_dim = 0
        elif first.dim() > 1 and first.shape[1] == self._num_blocks:
            block_dim = 1
        else:
            raise ConfigError(
                f"kvtier: unsupported KV cache layout {tuple(first.shape)}: no dimension of "
                f"size num_blocks={self._num_blocks} in position 0 or 1"
            )
        for name, layer in zip(names, layers, strict=True):
            if layer.shape != first.shape or layer.dtype != first.dtype:
                raise ConfigError(f"kvtier: layer {name} has another KV shape or dtype")
        self._layers, self._block_dim = layers, block_dim
        self._dtype = str(first.dtype).removeprefix("torch.")
        logger.info(
            "kvtier: %d KV layers of %s %s, block dim %d",
            len(layers),
            self._dtype,
            tuple(first.shape),
            block_dim,
        )

    # -- loads -------------------------------------------------------------------------

    def start_load_kv(self, plan: StepPlan) -> None:
        self._failed.update(plan.failed_blocks)
        for request in plan.loads:
            started = time.perf_counter()
            try:
                loaded = self._load_request(request)
            except Exception:
                logger.exception("kvtier: loading request %s failed; recomputing", request.req_id)
                loaded = 0
            failed = [b for c in request.chunks[loaded:] for b in c.block_ids]
            if failed:
                self._failed.update(failed)
                self._recorder.count("load_failed_blocks", len(failed))
            self._recorder.observe("load_seconds", time.perf_counter() - started)

    def failed_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call (then forgotten)."""
        failed, self._failed = self._failed, set()
        return failed

    def _load_request(self, request: RequestLoad) -> int:
        """Load the request's chunks in order; returns how many leading chunks landed."""
        keys = [c.keys[self._rank] for c in request.chunks]
        if not self._breaker.allow():
            self._recorder.count("calls_skipped", label="load")
            return 0
        try:
            blobs = list(
                self._tier.get(keys, stop_at_first_miss=True, timeout_s=self._config.load_timeout_s)
            )
        except TierError as exc:
            self._breaker.failure()
            self._recorder.count("errors", label="load")
            logger.warning("kvtier: Get of %d chunk(s) failed (%s); recomputing", len(keys), exc)
            return 0
        self._breaker.success()
        try:
            return self._scatter_all(keys, blobs, request)
        finally:
            self._tier.recycle(blobs)  # copied into the KV cache: their buffers serve later Gets

    def _scatter_all(
        self, keys: list[bytes], blobs: list[bytes | memoryview | None], request: RequestLoad
    ) -> int:
        for index, (key, chunk) in enumerate(zip(keys, request.chunks, strict=True)):
            blob = blobs[index] if index < len(blobs) else None
            if blob is None:
                return index
            try:
                self._scatter(key, blob, chunk)
            except ChunkDecodeError as exc:
                self._recorder.count("corrupt_chunks", label=exc.reason)
                logger.warning("kvtier: a stored chunk failed verification (%s); deleting it", exc)
                self._sender.delete(key)
                return index
            self._recorder.count("loaded_chunks")
            self._recorder.count("loaded_bytes", memoryview(blob).nbytes)
        return len(request.chunks)

    def _scatter(self, key: bytes, blob: bytes | memoryview, chunk: ChunkLoad) -> None:
        decoded = decode_chunk(key, blob)
        axis = 1 + self._block_dim
        needed = chunk.first_block + len(chunk.block_ids)
        expected = self._chunk_shape(decoded.shape[axis] if len(decoded.shape) > axis else 0)
        if decoded.dtype != self._dtype or decoded.shape != expected or expected[axis] < needed:
            raise ChunkDecodeError(
                f"chunk is {decoded.dtype}{list(decoded.shape)}, this engine needs "
                f"{self._dtype}{list(self._chunk_shape(needed))} or more blocks",
                "shape",
            )
        with warnings.catch_warnings():
            # The payload is read-only; it is only copied from, never written.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(decoded.payload, dtype=torch.uint8)
        data = raw.view(self._layers[0].dtype).view(decoded.shape)
        source = data.narrow(axis, chunk.first_block, len(chunk.block_ids))
        index = torch.tensor(chunk.block_ids, dtype=torch.long, device=self._layers[0].device)
        for layer, part in zip(self._layers, source, strict=True):
            layer.index_copy_(self._block_dim, index, part.to(layer.device))

    # -- saves -------------------------------------------------------------------------

    def wait_for_save(self, plan: StepPlan) -> None:
        for save in plan.saves:
            if not self._sender.has_room():
                self._recorder.count("saves_dropped", label="queue_full")
                continue
            key = save.keys[self._rank]
            try:
                tensor = self._gather(save.block_ids)
                payload = tensor.view(torch.uint8).reshape(-1).numpy()
                encode = functools.partial(
                    encode_chunk,
                    key,
                    payload,
                    dtype=self._dtype,
                    shape=tuple(tensor.shape),
                    codec=self._config.codec,
                )
                if self._config.codec == "raw":
                    parts = encode()  # no work but a header: here, not on the sender
                    self._sender.offer(key, parts, sum(memoryview(p).nbytes for p in parts))
                else:  # compressing is real work: the sender thread does it
                    self._sender.offer(key, encode, 0)
            except Exception:
                logger.exception("kvtier: copying a chunk out of the KV cache failed")
                self._recorder.count("errors", label="save")

    def _gather(self, block_ids: Iterable[int]) -> torch.Tensor:
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self._layers[0].device)
        return torch.stack(
            [layer.index_select(self._block_dim, index) for layer in self._layers]
        ).cpu()

    def _chunk_shape(self, blocks: int) -> tuple[int, ...]:
        shape = list(self._layers[0].shape)
        shape[self._block_dim] = blocks
        return (len(self._layers), *shape)

    def shutdown(self) -> None:
        self._sender.close()
