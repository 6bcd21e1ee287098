"""A step whose load fails stores none of its chunks, on real KV tensors and a real tier.

vLLM counts a load's blocks as computed when it schedules the step, and learns that the
load failed only from the step's output: the step's forward has already computed the
prompt's later tokens on top of the unfilled blocks (of that request, and of any request
sharing them through vLLM's prefix cache). The chunks that step completes are wrong KV
under right keys, and an engine loading them would generate from wrong KV
(tests/e2e/test_vllm_text.py shows it on real vLLM). Under vLLM's asynchronous scheduling
the next step was scheduled before that output, so its chunks are dropped too.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier.connector import factory, metrics
from kvtier.connector.client.tierclient import TierClient
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.kv.layouts import KVContent, KVOrder
from kvtier.connector.kv.plan import ChunkLoad, ChunkSave, RequestLoad, StepPlan
from kvtier.connector.kv.worker import KvtierWorker
from kvtier.testing.tierproc import TierProcess

NUM_BLOCKS, SHAPE = 16, (1, 128, 8)
CONTENT = KVContent("cpu", heads=1, tokens=128, head_size=4, head_size_v=4, dtype="bfloat16")


def make_worker(tier: TierProcess, steps_ahead: int) -> KvtierWorker:
    config = ConnectorConfig.from_extra_config({"target": tier.target, "chunk_size": 256})
    link = factory.connect(config, metrics.KV)
    worker = KvtierWorker(
        config, link.client, rank=0, num_blocks=NUM_BLOCKS, layer_order=("l0",),
        breaker=link.breaker, recorder=link.recorder, steps_ahead=steps_ahead,
    )  # fmt: skip
    caches = {"l0": torch.randn(NUM_BLOCKS, *SHAPE).to(torch.bfloat16)}
    worker.register_kv_caches(caches, order=KVOrder.named("LBHNC"), content=CONTENT)
    return worker


@pytest.fixture(params=[0, 1], ids=["sync", "async-scheduling"])
def worker(tier: TierProcess, request: pytest.FixtureRequest) -> Iterator[KvtierWorker]:
    worker = make_worker(tier, request.param)
    yield worker
    worker.shutdown()


@pytest.fixture
def client(tier: TierProcess) -> Iterator[TierClient]:
    with TierClient(tier.target) as client:
        yield client


def run_step(worker: KvtierWorker, plan: StepPlan) -> None:
    worker.start_load_kv(plan)
    worker.save_kv_layer("l0", plan)
    worker.wait_for_save(plan)
    assert worker.sender.flush(10.0)


def saves(name: str) -> list[ChunkSave]:
    return [ChunkSave((f"{name}-{i}".encode(),), (2 * i, 2 * i + 1)) for i in range(2)]


def stored(client: TierClient, name: str) -> int:
    return sum(
        v is not None
        for v in client.get([f"{name}-{i}".encode() for i in range(2)], stop_at_first_miss=False)
    )


def missing_load(req_id: str = "r", report: bool = False) -> RequestLoad:
    return RequestLoad(req_id, (ChunkLoad((b"absent",), 0, (8, 9)),), report=report)


def test_a_step_whose_load_failed_stores_none_of_its_chunks(
    worker: KvtierWorker, client: TierClient
) -> None:
    run_step(worker, StepPlan(loads=[missing_load()], saves=saves("failed-step")))

    assert worker.failed_blocks() == {8, 9}
    assert stored(client, "failed-step") == 0
    assert worker._recorder.total("saves_dropped", "load_failed") == 2


def test_the_steps_vllm_scheduled_after_it_saw_the_failure_store_again(
    worker: KvtierWorker, client: TierClient
) -> None:
    """Synchronous scheduling: the very next step was planned after vLLM saw the failure;
    asynchronous: one step later."""
    ahead = worker._steps_ahead
    run_step(worker, StepPlan(loads=[missing_load()], saves=saves("step-0")))
    for step in range(1, 3):
        run_step(worker, StepPlan(saves=saves(f"step-{step}")))
        assert stored(client, f"step-{step}") == (0 if step <= ahead else 2)
    assert worker._recorder.total("saves_dropped", "load_failed") == 2 + 2 * ahead


def test_blocks_the_scheduler_could_not_plan_drop_the_steps_saves(
    worker: KvtierWorker, client: TierClient
) -> None:
    run_step(worker, StepPlan(saves=saves("unplanned"), failed_blocks=[5]))
    assert stored(client, "unplanned") == 0
    assert worker.failed_blocks() == {5}


def test_a_failed_reported_load_keeps_the_steps_saves(
    worker: KvtierWorker, client: TierClient
) -> None:
    """A load vLLM waits for: its request is not in the step's forward, and vLLM
    recomputes it from its start; nothing of this step was computed on its blocks."""
    run_step(worker, StepPlan(loads=[missing_load(report=True)], saves=saves("reported")))
    assert worker.finished_loads() == ({"r"}, {"r"})
    assert stored(client, "reported") == 2


def test_a_step_whose_loads_all_arrived_stores_its_chunks(
    worker: KvtierWorker, client: TierClient
) -> None:
    run_step(worker, StepPlan(saves=saves("source")))
    load = RequestLoad("r", (ChunkLoad((b"source-0",), 0, (8, 9)),))
    run_step(worker, StepPlan(loads=[load], saves=saves("after-a-hit")))
    assert worker.failed_blocks() == set()
    assert stored(client, "after-a-hit") == 2
