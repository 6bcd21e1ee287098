"""Blocks between the engine's KV cache and host memory, on copy streams (kv/streams.py).

One engine step, and what each call enqueues or waits for::

    load(chunks)      loads stream: wait for the compute stream's work so far (the blocks
                      may still be in use by the last step), then per layer: each chunk's
                      bytes of that layer host -> device, scattered into its blocks, and an
                      event per layer
    wait_layer(i)     the compute stream waits for layer i's event (a GPU-side wait; on the
                      CPU it blocks until the copy ran): layer i's blocks are loaded before
                      anything enqueued after it reads them
    save(blocks)      host buffers for the step's saves, ``[layers, k, heads, tokens, width]``
    save_layer(i)     saves stream: wait for the compute stream (layer i's KV is written),
                      gather layer i's blocks, device -> host into each save's buffer
    finish_saves()    the layers ``save_layer`` was not called for, then block until every
                      save copy completed: only then are the buffers handed out
    release()         the host memory a load read, once its copies completed (the last
                      layer's event): never earlier, so a receive buffer given back to the
                      tier client is never refilled while a copy still reads it

On a GPU the host side is page-locked (pinned) memory, so copies are DMA transfers that
overlap the forward pass; a chunk that arrived in ordinary memory is first copied into
pinned memory (a CPU memcpy), because a copy from pageable memory stalls the stream.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.connector.kv.layouts import BlockView
from kvtier.connector.kv.streams import CopyStreams, Event, InlineStream


@dataclass(frozen=True)
class LoadChunk:
    """Blocks ``first_block : first_block + len(block_ids)`` of a stored chunk (its
    ``payload``: ``[layers, stored_blocks, heads, tokens, width]``) into ``block_ids``."""

    payload: memoryview
    stored_blocks: int
    first_block: int
    block_ids: tuple[int, ...]


@dataclass
class _Loads:
    chunks: Sequence[LoadChunk]
    keep: list[Any]
    """What must outlive the copies (the tier's values), handed back by ``release``."""
    sources: list[torch.Tensor] = field(default_factory=list)
    index: torch.Tensor | None = None
    """Every chunk's blocks, in chunk order, on the cache's device."""
    done: Event | None = None

    def forget(self) -> None:
        """Drop every reference to the loaded values (queued work may keep this object)."""
        self.chunks = []
        self.keep = []
        self.sources.clear()


@dataclass
class _Saves:
    buffers: list[torch.Tensor]
    index: torch.Tensor | None = None
    """Every save's blocks, in save order, on the cache's device."""
    layers: set[int] = field(default_factory=set)
    """Layers whose copies are enqueued."""


class KVCopier:
    def __init__(
        self, views: Sequence[BlockView], *, dtype: torch.dtype, streams: CopyStreams
    ) -> None:
        self._views = list(views)
        self._dtype = dtype
        self._device = views[0].layer.device
        self._pinned: bool = self._device.type == "cuda"
        # Asynchronous copies go through a staging tensor on the cache's device (on a GPU
        # the DMA target; the thread streams of the tests and the CPU benchmark take the
        # same path); inline ones (the CPU backend) scatter straight from the bytes.
        self._staged = not isinstance(streams.loads, InlineStream)
        self._streams = streams
        self._page_bytes = math.prod(views[0].page_shape) * views[0].layer.element_size()
        self._layer_events: list[Event] = []
        self._pending: list[_Loads] = []
        self._free: list[Any] = []
        self._saves: _Saves | None = None

    @property
    def layers(self) -> int:
        return len(self._views)

    @property
    def page_shape(self) -> tuple[int, ...]:
        return self._views[0].page_shape

    @property
    def pinned(self) -> bool:
        """True when host buffers are pinned (the engine is on a GPU)."""
        return self._pinned

    # -- loads -------------------------------------------------------------------------

    def load(self, chunks: Sequence[LoadChunk], keep: list[Any]) -> None:
        """Enqueue the chunks' copies, layer by layer; ``keep`` is handed back by
        ``release`` once they completed."""
        self._layer_events = []
        if not chunks:  # nothing reads them
            self._free += keep
            return
        step = _Loads(chunks, keep)
        streams = self._streams
        self._pending.append(step)  # first: copies enqueued before a failure read ``keep`` too
        try:
            streams.loads.wait(streams.compute.record())
            streams.loads.run(lambda: self._prepare_loads(step))
            for layer in range(len(self._views)):
                streams.loads.run(functools.partial(self._load_layer, step, layer))
                self._layer_events.append(streams.loads.record())
        except BaseException:
            # Enqueueing failed half-way (a CUDA stream raises in the caller, e.g. when a
            # layer's staging tensor finds no device memory): the caller fails the blocks.
            # Every layer's wait then waits for what was enqueued, and ``release`` holds
            # ``keep`` until that ran (forever, if not even an event can be recorded).
            self._layer_events = []
            with contextlib.suppress(Exception):
                step.done = streams.loads.record()
                self._layer_events = [step.done] * len(self._views)
            raise
        step.done = self._layer_events[-1]

    def new_step(self) -> None:
        """Forget the last step's load events (its loads are waited for or not needed)."""
        self._layer_events = []

    def wait_layer(self, layer: int) -> None:
        """Anything the compute stream runs from now on sees layer ``layer`` loaded (and
        every layer before it: one stream, in order)."""
        if self._layer_events:
            self._streams.compute.wait(self._layer_events[layer])

    def wait_loads(self) -> None:
        """``wait_layer`` of the last layer: every load of the step."""
        if self._layer_events:
            self._streams.compute.wait(self._layer_events[-1])

    def release(self, *, wait: bool = False) -> list[Any]:
        """What the loads whose copies completed kept (``wait``: wait for all first)."""
        kept, self._free = self._free, []
        still = []
        for step in self._pending:
            if step.done is None:  # enqueued half-way and no event recorded: never known done
                still.append(step)
                continue
            if wait:
                # A failed copy reads nothing more either: its memory is free then too.
                with contextlib.suppress(Exception):
                    step.done.synchronize()
            if step.done.query():
                kept += step.keep
                step.forget()  # nothing of ours may still see the values: they are recycled
            else:
                still.append(step)
        self._pending = still
        return kept

    def _prepare_loads(self, step: _Loads) -> None:
        for chunk in step.chunks:
            with warnings.catch_warnings():
                # The payload is read-only; it is only copied from, never written.
                warnings.simplefilter("ignore", UserWarning)
                source = torch.frombuffer(chunk.payload, dtype=torch.uint8)
            if self._pinned and not source.is_pinned():
                source = source.pin_memory()  # pageable memory would stall the stream
            step.sources.append(source)
        step.index = self._index([b for chunk in step.chunks for b in chunk.block_ids])

    def _load_layer(self, step: _Loads, layer: int) -> None:
        """Each chunk's bytes of ``layer`` into one staging tensor on the device (one DMA
        copy per chunk), then one scatter into the blocks; inline, each chunk is scattered
        straight from the received bytes."""
        assert step.index is not None
        view = self._views[layer]
        parts = []
        for chunk, source in zip(step.chunks, step.sources, strict=True):
            offset = (layer * chunk.stored_blocks + chunk.first_block) * self._page_bytes
            parts.append(source.narrow(0, offset, len(chunk.block_ids) * self._page_bytes))
        if not self._staged:
            first = 0
            for chunk, part in zip(step.chunks, parts, strict=True):
                count = len(chunk.block_ids)
                pages = part.view(self._dtype).view(count, *view.page_shape)
                view.scatter(step.index.narrow(0, first, count), pages)
                first += count
            return
        staging = torch.empty(len(step.index) * self._page_bytes, dtype=torch.uint8, device=self._device)
        first = 0
        for part in parts:
            staging.narrow(0, first, len(part)).copy_(part, non_blocking=True)
            first += len(part)
        view.scatter(step.index, staging.view(self._dtype).view(len(step.index), *view.page_shape))

    # -- saves -------------------------------------------------------------------------

    def save(self, blocks: Sequence[Sequence[int]]) -> None:
        """Host buffers for this step's saves (one per chunk, its blocks in order)."""
        shape = (len(self._views), *self.page_shape)
        buffers = [
            torch.empty(
                (shape[0], len(ids), *shape[1:]), dtype=self._dtype, pin_memory=self._pinned
            )
            for ids in blocks
        ]
        step = self._saves = _Saves(buffers)
        if blocks:
            ids = [b for chunk in blocks for b in chunk]
            self._streams.saves.run(lambda: setattr(step, "index", self._index(ids)))

    def save_layer(self, layer: int) -> None:
        """Enqueue layer ``layer``'s save copies behind the compute stream's work so far."""
        step = self._saves
        if step is None or not step.buffers or layer in step.layers:
            return
        step.layers.add(layer)
        streams = self._streams
        streams.saves.wait(streams.compute.record())
        streams.saves.run(functools.partial(self._save_layers, step, [layer]))

    def finish_saves(self) -> list[torch.Tensor]:
        """Every save's buffer, filled: the layers not saved yet are enqueued now, then
        this blocks until all save copies completed. Raises if a copy failed."""
        step, self._saves = self._saves, None
        if step is None or not step.buffers:
            return []
        missing = [i for i in range(len(self._views)) if i not in step.layers]
        streams = self._streams
        if missing:
            streams.saves.wait(streams.compute.record())
            streams.saves.run(functools.partial(self._save_layers, step, missing))
        streams.saves.record().synchronize()
        return step.buffers

    def _save_layers(self, step: _Saves, layers: Sequence[int]) -> None:
        """Per layer: one gather of every save's blocks, then one copy per save into its
        host buffer."""
        assert step.index is not None
        for layer in layers:
            pages = self._views[layer].gather(step.index)
            first = 0
            for buffer in step.buffers:
                count = buffer.shape[1]
                buffer[layer].copy_(pages.narrow(0, first, count), non_blocking=True)
                first += count

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        index = torch.tensor(list(block_ids), dtype=torch.long)
        if self._pinned:
            return index.pin_memory().to(self._device, non_blocking=True)
        return index.to(self._device)

    def close(self) -> None:
        self.release(wait=True)
        self._streams.close()
