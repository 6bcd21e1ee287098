"""The worker half: chunks into KV blocks before their layers run, and out after.

A chunk's payload is its blocks of every attention layer of one KV cache group in
logical order, ``[layers, blocks, heads, tokens, width]`` (kv/layouts.py: the same
bytes whatever the physical order of the engine's KV cache). On the CPU backend a block
of a layer is ``[kv_heads, block_size, 2 * head_size]``. An engine with several groups
(vLLM's hybrid KV cache manager) stores one such object per chunk and group, holding the
blocks the group keeps (kv/groups.py), its header naming the group and the first block
it holds; a chunk of another group, or of an engine with the manager in the other
state, is refused (``shape``).

One engine step (vLLM's connector calls, in order)::

    start_load_kv        one Get per request (blocking, bounded by load_timeout_s), every
                         chunk verified (decode_chunk: fingerprint, length, checksum; then
                         dtype, shape and group), the verified ones' copies enqueued layer
                         by layer, per group (kv/groupcopies.py, kv/copies.py); a chunk
                         that is missing, late, corrupt or of another shape fails itself
                         and every later chunk of its request: their blocks go to
                         ``failed_blocks()`` (vLLM recomputes them), or, for a load vLLM
                         waits for (``RequestLoad.report``: several groups), the request
                         is reported failed as a whole through ``finished_loads()``
    wait_for_layer_load  the forward waits for that layer's copies (layerwise)
    save_kv_layer        that layer's blocks of this step's new full chunks are copied out
                         behind the layer's compute (layerwise)
    wait_for_save        the copies not enqueued yet, then wait for all save copies; each
                         chunk goes to the background sender (which compresses it when
                         ``codec`` is not ``raw``: never on the engine's thread); none
                         when a load of this step (or of the step before, under vLLM's
                         asynchronous scheduling) left blocks unfilled: the forward
                         computed on top of them (``_saves_unsafe``)

On a GPU the copies run on two side CUDA streams with pinned host memory (the tier
client receives loaded chunks into pinned buffers), so loads overlap the layers still
computing and saves overlap the rest of the step. With ``layerwise: false`` (keeps
vLLM's full CUDA graphs) the forward waits for all loads before its first layer and the
saves are all copied in ``wait_for_save``. A reported load's request is not in this
step's forward (vLLM waits for it; on a step whose loads are all reported, vLLM 0.32
calls ``start_load_kv`` after it launched the forward): its request is reported loaded
(``finished_loads``) only once its copies are done, so the step that reads its blocks
comes after them. On the CPU backend
every copy runs at once on the engine's thread (loads in ``start_load_kv``, saves in
``wait_for_save``).

The tier's values a load read are given back to the client (``recycle``: their buffers
receive later Gets) only once the copies that read them completed (their event).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.connector.chunks.codec import decode_chunk, encode_chunk
from kvtier.connector.chunks.finite import first_nonfinite
from kvtier.connector.client.breaker import CircuitBreaker
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.errors import ChunkDecodeError, ConfigError, NonFiniteChunk, TierError
from kvtier.connector.kv.copies import KVCopier, LoadChunk
from kvtier.connector.kv.groupcopies import GroupCopies
from kvtier.connector.kv.groups import KVGroup
from kvtier.connector.kv.layouts import KVContent, KVOrder
from kvtier.connector.kv.plan import ChunkLoad, ChunkSave, RequestLoad, StepPlan
from kvtier.connector.kv.streams import CopyStreams
from kvtier.connector.metrics import Recorder
from kvtier.connector.sender import SaveSender, refuse_nonfinite
from kvtier.connector.tiercalls import GetTier

logger = logging.getLogger(__name__)

__all__ = ["KvtierWorker"]

Kept = list[bytes | memoryview | None]
"""Values of the tier a load read, per group: given back once that group's copies ran."""


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
        groups: Sequence[KVGroup] = (),
        streams: CopyStreams | None = None,
        steps_ahead: int = 0,
    ) -> None:
        """``layer_order``: the layers of an engine with one KV cache group; ``groups``
        (each with its layer names): any engine. ``streams``: where copies run (default:
        side CUDA streams on a GPU, the engine's thread on the CPU); tests and the
        benchmark pass ``CopyStreams.threads()``. ``steps_ahead``: how many steps vLLM
        schedules before it has seen a step's output (1 with its asynchronous
        scheduling, else 0)."""
        self._config = config
        self._tier = tier
        self._rank = rank
        self._num_blocks = num_blocks
        self._group_names = [list(g.layer_names) for g in groups] or [list(layer_order)]
        self._tags = [g.tag for g in groups] or [""]
        self._breaker = breaker
        self._recorder = recorder
        self._streams = streams
        self._layerwise = config.layerwise
        self._copies: GroupCopies | None = None
        self._dtypes: list[str] = []
        self._values: list[str] = []
        self._failed: set[int] = set()
        self._finished_loads: set[str] = set()
        self._failed_loads: set[str] = set()
        self._plan: StepPlan | None = None
        self._saves: list[ChunkSave] = []
        self._steps_ahead = steps_ahead
        self._step = 0
        self._unsafe_until = -1
        """The last step whose saves may hold KV computed on top of a failed load."""
        self._sender = SaveSender.for_saves(
            tier, config, breaker=breaker, recorder=recorder, per_chunk=len(self._tags)
        )

    @property
    def sender(self) -> SaveSender:
        return self._sender

    @property
    def group_layers(self) -> list[list[str]]:
        """Each KV cache group's layer names, in the order vLLM gave them."""
        return [list(names) for names in self._group_names]

    @property
    def layer_order(self) -> list[str]:
        """The layer names of every group, group by group."""
        return [name for names in self._group_names for name in names]

    @property
    def layerwise(self) -> bool:
        """Whether loads and saves follow the forward layer by layer."""
        return self._layerwise

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        *,
        order: KVOrder,
        content: KVContent | Sequence[KVContent],
        values: Sequence[str] | None = None,
    ) -> None:
        """The engine's per-layer ``[B, H, N, C]`` views; ``content``: what a page holds,
        one for every group or one per group. ``values``: per group, the dtype the NaN scan
        reads its pages as (``vllmspec.value_dtypes``: an fp8 cache's type; ``""``: not
        scanned); by default each content's dtype. ``ConfigError`` when a layer does not
        fit ``order`` and its group's content (what vLLM reported)."""
        contents = [content] * len(self._tags) if isinstance(content, KVContent) else list(content)
        if len(self._group_names) == 1:
            names = [n for n in self._group_names[0] if n in kv_caches] or list(kv_caches)
            self._group_names = [names]
        streams = self._streams
        device = kv_caches[self._group_names[0][0]].device
        if streams is None:
            if device.type == "cuda":
                streams = CopyStreams.cuda(device)
            else:  # nothing to overlap: copies run on the engine's thread, as ever
                streams = CopyStreams.inline()
                self._layerwise = False
        self._copies = GroupCopies.build(
            kv_caches, self._group_names, contents, num_blocks=self._num_blocks, order=order,
            streams=streams,
        )  # fmt: skip
        self._dtypes = [c.dtype for c in contents]
        self._values = list(values) if values is not None else list(self._dtypes)
        if len(self._values) != len(contents):
            raise ConfigError(f"kvtier: {len(self._values)} value dtypes for {len(contents)} KV cache groups")
        if self._copies.pinned:
            self._tier.receive_into(_pinned_bytes)
        logger.info(
            "kvtier: %d KV layers in %d group(s), %s layout, %s content %s %s per block, "
            "%s copies%s",
            self._copies.layers, len(self._copies), order.name, contents[0].family,
            contents[0].dtype, self._copies.copier(0).page_shape,
            "layerwise" if self._layerwise else "whole-step",
            ", pinned host memory" if self._copies.pinned else "",
        )  # fmt: skip

    @property
    def copies(self) -> GroupCopies:
        assert self._copies is not None, "register_kv_caches was not called"
        return self._copies

    @property
    def copier(self) -> KVCopier:
        """The first (for most models the only) KV cache group's copies."""
        return self.copies.copier(0)

    def _begin(self, plan: StepPlan) -> None:
        """Start a new step the first time one of its calls comes."""
        if plan is self._plan:
            return
        self._plan = plan
        self._step += 1
        self.copies.new_step()
        self._recycle()
        self._saves = []
        if plan.saves:
            self._saves = self._chosen_saves(plan.saves)
            try:
                self.copies.save([(s.group, s.block_ids) for s in self._saves])
            except Exception:
                logger.exception("kvtier: preparing this step's saves failed")
                self._recorder.count("errors", label="save")
                self._saves = []

    # -- loads -------------------------------------------------------------------------

    def start_load_kv(self, plan: StepPlan) -> None:
        self._begin(plan)
        if plan.failed_blocks:
            self._failed.update(plan.failed_blocks)
            self._saves_unsafe()
        loads: dict[int, list[tuple[RequestLoad, LoadChunk]]] = {}
        keep: dict[int, Kept] = {}
        for request in plan.loads:
            started = time.perf_counter()
            fetched: list[tuple[int, LoadChunk]] = []
            try:
                fetched = self._fetch(request, keep)
            except Exception:
                logger.exception("kvtier: loading request %s failed; recomputing", request.req_id)
            self._fail(request, [b for c in request.chunks[len(fetched) :] for b in c.block_ids])
            for group, chunk in fetched:
                loads.setdefault(group, []).append((request, chunk))
            if request.report:
                self._finished_loads.add(request.req_id)
            self._recorder.observe("load_seconds", time.perf_counter() - started)
        for group in sorted(loads.keys() | keep.keys()):
            chunks = loads.get(group, [])
            copier = self.copies.copier(group)
            try:
                copier.load([c for _, c in chunks], keep.get(group, []))
            except Exception:
                logger.exception(
                    "kvtier: copying %d chunk(s) into the KV cache failed", len(chunks)
                )
                for request, chunk in chunks:
                    self._fail(request, chunk.block_ids)
                # What was enqueued before the failure still runs: every layer's wait waits
                # for it, and its buffers go back with the next step's (``_recycle``) once it ran.
        if not self._layerwise or any(r.report for r in plan.loads):
            self.copies.wait_loads()
        self._failed_loads.update(plan.failed_loads)
        self._finished_loads.update(plan.failed_loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layerwise:
            self.copies.wait_layer(layer_name)

    def failed_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call (then forgotten)."""
        failed, self._failed = self._failed, set()
        return failed

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Reported loads done since the last call, and those of them that failed."""
        done, failed = self._finished_loads, self._failed_loads
        self._finished_loads, self._failed_loads = set(), set()
        return done, failed

    def _fail(self, request: RequestLoad, blocks: Sequence[int]) -> None:
        """Blocks of ``request`` whose load failed: recomputed, or, for a reported load,
        the whole request reported failed."""
        if not blocks:
            return
        self._recorder.count("load_failed_blocks", len(blocks))
        if request.report:
            self._failed_loads.add(request.req_id)
        else:
            self._failed.update(blocks)
            self._saves_unsafe()

    def _saves_unsafe(self) -> None:
        """A block vLLM counts as loaded stays unfilled this step. vLLM recomputes from it
        only after the step, whose forward computes later tokens on top of it (of that
        request, and of any request sharing the block through vLLM's prefix cache): the
        chunks such a step completes are wrong KV under right keys. So this step stores
        no chunk, nor do the steps vLLM scheduled before it sees this one's output; the
        scheduler saves the recomputed chunks again (``KvtierScheduler.blocks_failed``)."""
        self._unsafe_until = self._step + self._steps_ahead

    def _fetch(self, request: RequestLoad, keep: dict[int, Kept]) -> list[tuple[int, LoadChunk]]:
        """The request's leading chunks that arrived and verified, in order, with their
        group; the values fetched go to ``keep`` (given back once the copies of their
        group completed)."""
        keys = [c.keys[self._rank] for c in request.chunks]
        if not self._breaker.allow():
            self._recorder.count("calls_skipped", label="load")
            return []
        try:
            blobs = list(
                self._tier.get(keys, stop_at_first_miss=True, timeout_s=self._config.load_timeout_s)
            )
        except TierError as exc:
            self._breaker.failure()
            self._recorder.count("errors", label="load")
            logger.warning("kvtier: Get of %d chunk(s) failed (%s); recomputing", len(keys), exc)
            return []
        self._breaker.success()
        for chunk, blob in zip(request.chunks, blobs, strict=False):
            keep.setdefault(chunk.group, []).append(blob)
        fetched: list[tuple[int, LoadChunk]] = []
        for key, chunk, blob in zip(keys, request.chunks, blobs, strict=False):
            if blob is None:
                break
            try:
                fetched.append((chunk.group, self._verified(key, blob, chunk)))
            except ChunkDecodeError as exc:
                self._recorder.count("corrupt_chunks", label=exc.reason)
                logger.warning("kvtier: a stored chunk failed verification (%s); deleting it", exc)
                self._sender.delete(key)
                break
            self._recorder.count("loaded_chunks")
            self._recorder.count("loaded_bytes", memoryview(blob).nbytes)
        return fetched

    def _verified(self, key: bytes, blob: bytes | memoryview, chunk: ChunkLoad) -> LoadChunk:
        decoded = decode_chunk(key, blob)
        group = chunk.group
        stored = decoded.shape[1] if len(decoded.shape) > 1 else 0
        needed = chunk.first_block + len(chunk.block_ids)
        expected = self.copies.chunk_shape(group, stored)
        dtype = self._dtypes[group]
        if decoded.dtype != dtype or decoded.shape != expected or stored < needed:
            raise ChunkDecodeError(
                f"chunk is {decoded.dtype}{list(decoded.shape)}, this engine needs "
                f"{dtype}{list(self.copies.chunk_shape(group, needed))} or more blocks",
                "shape",
            )
        if (decoded.group, decoded.first_block) != (self._tags[group], chunk.stored_from):
            raise ChunkDecodeError(
                f"chunk holds group {decoded.group!r} from block {decoded.first_block}, this "
                f"engine needs {self._tags[group]!r} from block {chunk.stored_from}",
                "shape",
            )
        values = self._values[group]  # one such chunk would poison this engine (docs/connector.md)
        if (found := first_nonfinite(decoded.payload, values)) >= 0:
            raise ChunkDecodeError(
                f"chunk holds a NaN or an infinity ({values} element {found}): stored by a "
                "writer that does not check for them",
                "nonfinite",
            )
        return LoadChunk(decoded.payload, stored, chunk.first_block, chunk.block_ids)

    # -- saves -------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, plan: StepPlan) -> None:
        self._begin(plan)
        if self._layerwise and self._saves:
            self.copies.save_layer(layer_name)

    def wait_for_save(self, plan: StepPlan) -> None:
        self._begin(plan)
        saves, self._saves = self._saves, []
        try:
            buffers = self.copies.finish_saves()
        except Exception:
            logger.exception("kvtier: copying %d chunk(s) out of the KV cache failed", len(saves))
            self._recorder.count("errors", label="save")
            return
        finally:
            self._recycle()
        if saves and self._step <= self._unsafe_until:
            self._recorder.count("saves_dropped", len(saves), label="load_failed")
            return
        for save, buffer in zip(saves, buffers, strict=True):
            self._offer(save, buffer)

    def _chosen_saves(self, saves: Sequence[ChunkSave]) -> list[ChunkSave]:
        """The saves the sender has room for; the others are dropped now, not copied."""
        room = self._sender.room()
        if len(saves) > room:
            self._recorder.count("saves_dropped", len(saves) - room, label="queue_full")
        return list(saves[:room])

    def _offer(self, save: ChunkSave, buffer: torch.Tensor) -> None:
        key = save.keys[self._rank]
        try:
            payload = buffer.view(torch.uint8).reshape(-1).numpy()
            encode = functools.partial(
                encode_chunk, key, payload, dtype=self._dtypes[save.group],
                shape=tuple(buffer.shape), codec=self._config.codec,
                group=self._tags[save.group], first_block=save.stored_from,
                check_finite=self._values[save.group],
            )  # fmt: skip
            if self._config.codec == "raw":
                parts = encode()  # a header, the scan and the hash of the payload: cheap
                self._sender.offer(key, parts, sum(memoryview(p).nbytes for p in parts))
            else:  # compressing is real work: the sender thread does it
                self._sender.offer(key, encode, 0)
        except NonFiniteChunk as exc:
            refuse_nonfinite(self._recorder, exc)
        except Exception:
            logger.exception("kvtier: queueing a chunk for the tier failed")
            self._recorder.count("errors", label="save")

    def _recycle(self, *, wait: bool = False) -> None:
        kept = self.copies.release(wait=wait)
        if kept:
            self._tier.recycle(kept)  # their copies completed: the buffers serve later Gets

    def shutdown(self) -> None:
        if self._copies is not None:
            self._recycle(wait=True)
            self._copies.close()
        self._sender.close()


def _pinned_bytes(size: int) -> Any:
    """A page-locked host buffer of ``size`` bytes the tier client receives a value into
    (a numpy view; the tensor, and its pinned memory, lives as long as the view)."""
    return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
