"""The engine's KV caches per KV cache group: one ``KVCopier`` each, on shared streams.

An engine with vLLM's hybrid KV cache manager has several KV cache groups (Gemma 3: one
full-attention group, five sliding-window ones); each group's layers are one
``KVCopier`` (kv/copies.py: one gather or one staged scatter per layer for all of a
step's chunks *of that group*), all on the worker's one set of copy streams, so a step's
copies of every group run in order behind the compute stream. A layer belongs to one
group; ``locate`` says which and where. Groups share one block pool (vLLM's), so the
block ids of every group index the same ``num_blocks``; vLLM may back one layer of each
group with the same tensor (they never hold the same block), which is why a layer
reusing another's KV cache (KV sharing) is only recognised within its group.

``build`` checks every layer against what vLLM reported (``order``, and the group's
``KVContent``) and raises ``ConfigError`` naming the layer when one does not fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtier.connector.errors import ConfigError
from kvtier.connector.kv.copies import KVCopier
from kvtier.connector.kv.layouts import BlockView, KVContent, KVOrder
from kvtier.connector.kv.streams import CopyStreams

__all__ = ["GroupCopies"]


class GroupCopies:
    def __init__(
        self, copiers: Sequence[KVCopier], where: dict[str, tuple[int, int]], streams: CopyStreams
    ) -> None:
        self._copiers = list(copiers)
        self._where = where
        self._streams = streams
        self._saves: list[tuple[int, int]] = []
        """The step's saves: (group, position among that group's saves), in plan order."""

    @classmethod
    def build(
        cls,
        kv_caches: dict[str, torch.Tensor],
        group_layers: Sequence[Sequence[str]],
        contents: Sequence[KVContent],
        *,
        num_blocks: int,
        order: KVOrder,
        streams: CopyStreams,
    ) -> GroupCopies:
        copiers, where = [], {}
        device = None
        for group, (names, content) in enumerate(zip(group_layers, contents, strict=True)):
            views: list[BlockView] = []
            seen: set[tuple[int, tuple[int, ...]]] = set()
            for name in names:
                layer = kv_caches[name]
                identity = (layer.data_ptr(), tuple(layer.stride()))
                if identity in seen:  # a layer reusing another's KV cache (KV sharing)
                    continue
                seen.add(identity)
                views.append(_checked(name, layer, num_blocks, order, content))
                where[name] = (group, len(views) - 1)
            if not views:
                raise ConfigError(f"kvtier: KV cache group {group} has no KV layer")
            first = views[0].layer
            device = device or first.device
            if any(v.ratio != views[0].ratio or v.layer.device != device for v in views):
                raise ConfigError("kvtier: the KV layers differ in kernel block size or device")
            copiers.append(KVCopier(views, dtype=first.dtype, streams=streams))
        return cls(copiers, where, streams)

    def __len__(self) -> int:
        return len(self._copiers)

    def copier(self, group: int) -> KVCopier:
        return self._copiers[group]

    @property
    def layers(self) -> int:
        """KV layers of every group (each counted once)."""
        return sum(c.layers for c in self._copiers)

    @property
    def pinned(self) -> bool:
        return self._copiers[0].pinned

    def locate(self, layer_name: str) -> tuple[int, int] | None:
        """The layer's group and its position in that group's copier (None: not ours)."""
        return self._where.get(layer_name)

    def chunk_shape(self, group: int, blocks: int) -> tuple[int, ...]:
        """A stored chunk of ``group`` holding ``blocks`` blocks."""
        copier = self._copiers[group]
        return (copier.layers, blocks, *copier.page_shape)

    # -- a step --------------------------------------------------------------------------

    def new_step(self) -> None:
        for copier in self._copiers:
            copier.new_step()

    def wait_layer(self, layer_name: str) -> None:
        where = self._where.get(layer_name)
        if where is not None:
            self._copiers[where[0]].wait_layer(where[1])

    def wait_loads(self) -> None:
        for copier in self._copiers:
            copier.wait_loads()

    def save(self, saves: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Host buffers for this step's saves: ``(group, block ids)`` each, in plan order."""
        per_group: list[list[Sequence[int]]] = [[] for _ in self._copiers]
        self._saves = []
        for group, block_ids in saves:
            self._saves.append((group, len(per_group[group])))
            per_group[group].append(block_ids)
        for copier, blocks in zip(self._copiers, per_group, strict=True):
            copier.save(blocks)

    def save_layer(self, layer_name: str) -> None:
        where = self._where.get(layer_name)
        if where is not None:
            self._copiers[where[0]].save_layer(where[1])

    def finish_saves(self) -> list[torch.Tensor]:
        """Every save's filled buffer, in plan order (``KVCopier.finish_saves`` per group)."""
        saves, self._saves = self._saves, []
        buffers = [copier.finish_saves() for copier in self._copiers]
        return [buffers[group][position] for group, position in saves]

    def release(self, *, wait: bool = False) -> list[Any]:
        """What the loads of every group whose copies completed kept."""
        return [value for copier in self._copiers for value in copier.release(wait=wait)]

    def close(self) -> None:
        for copier in self._copiers:
            copier.release(wait=True)
        self._streams.close()


def _checked(
    name: str, layer: torch.Tensor, num_blocks: int, order: KVOrder, content: KVContent
) -> BlockView:
    ratio = layer.shape[0] // num_blocks if layer.dim() == 4 else 0
    fits = (
        ratio >= 1
        and layer.shape[0] == ratio * num_blocks
        and content.tokens % ratio == 0
        and tuple(layer.shape[1:]) == (content.heads, content.tokens // ratio, content.width)
    )
    if not fits:
        raise ConfigError(
            f"kvtier: KV layer {name} is {tuple(layer.shape)}; expected [num_blocks="
            f"{num_blocks} (or a multiple: kernel blocks), heads={content.heads}, "
            f"tokens={content.tokens} (or a divisor), width={content.width}] "
            f"({content.family} content)"
        )
    if str(layer.dtype).removeprefix("torch.") != content.dtype:
        raise ConfigError(f"kvtier: KV layer {name} holds {layer.dtype}, not {content.dtype}")
    if not order.matches(layer):
        raise ConfigError(
            f"kvtier: vLLM reported the {order.name} KV cache layout, but layer {name}'s "
            f"strides {tuple(layer.stride())} for shape {tuple(layer.shape)} are not in "
            "that order"
        )
    if ratio > 1 and content.family == "cpu":
        raise ConfigError("kvtier: CPU_ATTN KV caches split into kernel blocks are not supported")
    return BlockView(layer, num_blocks)
