"""The worker half with several KV cache groups, on real KV tensors and a real tier process.

Two groups of one layer each, as vLLM lays them out on the CPU with its hybrid KV cache
manager (each layer ``[num_blocks, kv_heads, block_size, 2 * head_size]``): group 0 a
sliding window that stores only the tail of a chunk, group 1 full attention. Every test
runs with the CPU backend's inline copies and with the asynchronous path (copies on
thread streams, layer by layer: what a GPU engine does, kv/streams.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier.connector import factory, metrics
from kvtier.connector.chunks.codec import decode_chunk
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.kv.groups import FULL, SLIDING_WINDOW, KVGroup
from kvtier.connector.kv.layouts import KVContent, KVOrder
from kvtier.connector.kv.plan import ChunkLoad, ChunkSave, RequestLoad, StepPlan
from kvtier.connector.kv.streams import CopyStreams
from kvtier.connector.kv.worker import KvtierWorker
from kvtier.testing.tierproc import TierProcess

NUM_BLOCKS, SHAPE = 16, (1, 128, 8)
CONTENT = KVContent("cpu", heads=1, tokens=128, head_size=4, head_size_v=4, dtype="bfloat16")
SWA, FULL_ATTENTION = 0, 1
GROUPS = [
    KVGroup(128, SLIDING_WINDOW, 128, tag="0/2 sliding_window=128", layer_names=("l0",)),
    KVGroup(128, FULL, tag="1/2 full", layer_names=("l1",)),
]


@pytest.fixture(params=["inline", "threads"])
def worker(tier: TierProcess, request: pytest.FixtureRequest) -> Iterator[KvtierWorker]:
    config = ConnectorConfig.from_extra_config({"target": tier.target, "chunk_size": 256})
    link = factory.connect(config, metrics.KV)
    streams = CopyStreams.threads() if request.param == "threads" else None
    worker = KvtierWorker(
        config, link.client, rank=0, num_blocks=NUM_BLOCKS, layer_order=(),
        breaker=link.breaker, recorder=link.recorder, groups=GROUPS, streams=streams,
    )  # fmt: skip
    torch.manual_seed(0)
    caches = {name: torch.randn(NUM_BLOCKS, *SHAPE).to(torch.bfloat16) for name in ("l0", "l1")}
    worker.register_kv_caches(caches, order=KVOrder.named("LBHNC"), content=CONTENT)
    worker.caches = caches  # type: ignore[attr-defined]
    assert worker.layerwise == (request.param == "threads")
    yield worker
    worker.shutdown()
    link.close()


def layer(worker: KvtierWorker, group: int) -> torch.Tensor:
    return worker.caches[f"l{group}"]  # type: ignore[attr-defined,no-any-return]


def save(worker: KvtierWorker) -> None:
    """One step saving a chunk of each group, its layers copied out as the forward passes
    them (layerwise workers) or after it."""
    plan = StepPlan(
        saves=[
            ChunkSave((b"swa-0",), (3,), group=SWA, stored_from=1),
            ChunkSave((b"full-0",), (4, 5), group=FULL_ATTENTION),
        ]
    )
    worker.start_load_kv(plan)
    for name in ("l0", "l1"):
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, plan)
    worker.wait_for_save(plan)
    assert worker.sender.flush(10.0)


def test_each_group_saves_its_own_blocks_under_its_tag(worker: KvtierWorker) -> None:
    save(worker)
    swa, full = worker._tier.get([b"swa-0", b"full-0"])
    assert swa is not None and full is not None
    decoded = decode_chunk(b"swa-0", swa)
    assert (decoded.group, decoded.first_block, decoded.shape) == (GROUPS[0].tag, 1, (1, 1, *SHAPE))
    assert decode_chunk(b"full-0", full).group == "1/2 full"


def test_each_groups_saved_bytes_are_its_blocks(worker: KvtierWorker) -> None:
    save(worker)
    swa, full = worker._tier.get([b"swa-0", b"full-0"])
    assert swa is not None and full is not None
    for key, blob, group, blocks in ((b"swa-0", swa, SWA, [3]), (b"full-0", full, FULL_ATTENTION, [4, 5])):
        decoded = decode_chunk(key, blob)
        stored = torch.frombuffer(bytearray(decoded.payload), dtype=torch.bfloat16)
        assert torch.equal(stored.view(decoded.shape)[0], layer(worker, group)[blocks])


def test_a_layerwise_load_of_several_groups_lands_layer_by_layer(worker: KvtierWorker) -> None:
    save(worker)
    chunks = (
        ChunkLoad((b"full-0",), 0, (8, 9), group=FULL_ATTENTION),
        ChunkLoad((b"swa-0",), 0, (10,), group=SWA, stored_from=1),
    )
    plan = StepPlan(loads=[RequestLoad("r", chunks)])
    worker.start_load_kv(plan)
    worker.wait_for_layer_load("l1")  # the full group's layer
    assert torch.equal(layer(worker, FULL_ATTENTION)[8:10], layer(worker, FULL_ATTENTION)[4:6])
    worker.wait_for_layer_load("l0")
    assert torch.equal(layer(worker, SWA)[10], layer(worker, SWA)[3])
    worker.wait_for_save(plan)
    assert worker.failed_blocks() == set()


def test_layers_of_two_groups_on_one_tensor_are_both_kept(tier: TierProcess) -> None:
    """vLLM backs layer i of every group with one tensor (the groups never hold the same
    block): that is not KV sharing, and both layers are copied."""
    config = ConnectorConfig.from_extra_config({"target": tier.target, "chunk_size": 256})
    link = factory.connect(config, metrics.KV)
    worker = KvtierWorker(
        config, link.client, rank=0, num_blocks=NUM_BLOCKS, layer_order=(),
        breaker=link.breaker, recorder=link.recorder, groups=GROUPS,
    )  # fmt: skip
    shared = torch.zeros(NUM_BLOCKS, *SHAPE, dtype=torch.bfloat16)
    try:
        worker.register_kv_caches(
            {"l0": shared, "l1": shared}, order=KVOrder.named("LBHNC"), content=CONTENT
        )
        assert worker.copies.layers == 2
        assert worker.copies.locate("l0") == (SWA, 0)
        assert worker.copies.locate("l1") == (FULL_ATTENTION, 0)
    finally:
        worker.shutdown()
        link.close()


def test_a_reported_load_fills_each_groups_blocks_and_is_reported_finished(
    worker: KvtierWorker,
) -> None:
    save(worker)
    chunks = (
        ChunkLoad((b"full-0",), 0, (8, 9), group=FULL_ATTENTION),
        ChunkLoad((b"swa-0",), 0, (10,), group=SWA, stored_from=1),
    )
    worker.start_load_kv(StepPlan(loads=[RequestLoad("r", chunks, report=True)]))

    assert torch.equal(layer(worker, FULL_ATTENTION)[8:10], layer(worker, FULL_ATTENTION)[4:6])
    assert torch.equal(layer(worker, SWA)[10], layer(worker, SWA)[3])
    assert worker.finished_loads() == ({"r"}, set())
    assert worker.finished_loads() == (set(), set())  # reported once
    assert worker.failed_blocks() == set()


def test_a_chunk_of_another_group_is_refused_and_the_load_reported_failed(
    worker: KvtierWorker,
) -> None:
    save(worker)
    before = layer(worker, FULL_ATTENTION)[11].clone()
    # The sliding-window group's chunk asked for as the full group's (same shape).
    wrong = ChunkLoad((b"swa-0",), 0, (11,), group=FULL_ATTENTION, stored_from=1)

    worker.start_load_kv(StepPlan(loads=[RequestLoad("r", (wrong,), report=True)]))

    assert worker.finished_loads() == ({"r"}, {"r"})
    assert worker.failed_blocks() == set()  # vLLM 0.32 refuses those with several groups
    assert torch.equal(layer(worker, FULL_ATTENTION)[11], before)
    assert worker._recorder.total("corrupt_chunks", "shape") == 1


def test_a_missing_chunk_fails_a_reported_load(worker: KvtierWorker) -> None:
    load = RequestLoad("r", (ChunkLoad((b"absent",), 0, (8,), group=FULL_ATTENTION),), report=True)
    worker.start_load_kv(StepPlan(loads=[load]))
    assert worker.finished_loads() == ({"r"}, {"r"})


def test_a_load_the_scheduler_could_not_plan_is_reported_failed(worker: KvtierWorker) -> None:
    worker.start_load_kv(StepPlan(failed_loads=["r"]))
    assert worker.finished_loads() == ({"r"}, {"r"})
