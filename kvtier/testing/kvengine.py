"""A stand-in for vLLM around the connector's KV worker: its KV caches, and its steps.

``KVEngine`` allocates KV caches the way vLLM 0.32 does (``kv.layouts.allocate``: one
backing buffer, a ``[blocks, heads, tokens, width]`` view per layer in a given order),
registers them with a real ``KvtierWorker`` talking to a real tier, and runs engine
steps calling the worker in vLLM's order::

    start_load_kv(plan)
    for each layer:  wait_for_layer_load(layer); compute(layer); save_kv_layer(layer)
    wait_for_save(plan)

``compute(layer)`` stands for the layer's forward (it may write the layer's KV). Used by
the connector's tests and by the GPU benchmark (kvtier/bench/gpu.py), which needs no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier.connector.client import TierClient
from kvtier.connector.client.breaker import CircuitBreaker
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.kv.layouts import KVContent, KVOrder, allocate
from kvtier.connector.kv.plan import ChunkLoad, ChunkSave, RequestLoad, StepPlan
from kvtier.connector.kv.streams import CopyStreams
from kvtier.connector.kv.worker import KvtierWorker
from kvtier.connector.metrics import KV, Recorder


def layer_names(layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(layers)]


class KVEngine:
    def __init__(
        self,
        target: str,
        order: str,
        content: KVContent,
        *,
        layers: int,
        blocks: int,
        chunk_blocks: int,
        streams: CopyStreams | None = None,
        device: str | torch.device = "cpu",
        data_path: str = "data",
        **config: Any,
    ) -> None:
        self.content = content
        self.order = KVOrder.named(order)
        self.names = layer_names(layers)
        self.chunk_blocks = chunk_blocks
        self.caches = allocate(self.order, content, layers=layers, blocks=blocks, device=device)
        self.client = TierClient(target, data_path=data_path)
        self.recorder = Recorder(KV)
        config.setdefault("chunk_size", chunk_blocks * content.tokens)
        self.worker = KvtierWorker(
            ConnectorConfig(target=target, **config),
            self.client,
            rank=0,
            num_blocks=blocks,
            layer_order=self.names,
            breaker=CircuitBreaker(3, 1.0),
            recorder=self.recorder,
            streams=streams,
        )
        self.worker.register_kv_caches(
            dict(zip(self.names, self.caches, strict=True)), order=self.order, content=content
        )

    def step(self, plan: StepPlan, compute: Callable[[int], None] | None = None) -> set[int]:
        """One engine step; returns the blocks whose load failed."""
        self.worker.start_load_kv(plan)
        for index, name in enumerate(self.names):
            self.worker.wait_for_layer_load(name)
            if compute is not None:
                compute(index)
            self.worker.save_kv_layer(name, plan)
        self.worker.wait_for_save(plan)
        return self.worker.failed_blocks()

    def fill(self, seed: int) -> torch.Tensor:
        """Random values in every block of every layer; returns them, ``[layers, blocks,
        heads, tokens, width]`` (a copy, in logical order)."""
        gen = torch.Generator(device=self.caches[0].device).manual_seed(seed)
        values = torch.randint(
            0, 250, (len(self.caches), *self.caches[0].shape), generator=gen,
            device=self.caches[0].device,
        ).to(self.caches[0].dtype)  # fmt: skip
        for layer, value in zip(self.caches, values, strict=True):
            layer.copy_(value)
        return values

    def blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks' values in every layer, ``[layers, k, heads, tokens, width]``."""
        index = torch.tensor(list(block_ids), device=self.caches[0].device)
        return torch.stack([layer.index_select(0, index) for layer in self.caches])

    def close(self) -> None:
        self.worker.shutdown()
        self.client.close()


def save_plan(*saves: tuple[bytes, Sequence[int]]) -> StepPlan:
    return StepPlan(saves=[ChunkSave(keys=(key,), block_ids=tuple(ids)) for key, ids in saves])


def load_plan(*chunks: tuple[bytes, Sequence[int]], req_id: str = "r") -> StepPlan:
    """One request loading whole chunks (in prefix order) into the given blocks."""
    loads = tuple(ChunkLoad(keys=(key,), first_block=0, block_ids=tuple(ids)) for key, ids in chunks)
    return StepPlan(loads=[RequestLoad(req_id, loads)])
