"""The worker's asynchronous copies and their synchronisation with vLLM's calls, on the CPU.

The copies run on ``ThreadStream``s (kv/streams.py): real threads, so a copy really
happens later than the call that enqueued it, held by a ``Gate`` the test opens piece
by piece, or delayed at random. The engine's compute stream is the caller's thread
(``InlineStream``), whose ``wait`` blocks, as a CUDA stream's wait holds the kernels
after it. Chunks go through a real ``kvtier server`` (data port) with a real
``TierClient``, whose receive buffers are recycled.

The contract: layer i's blocks are loaded before ``wait_for_layer_load(i)`` returns;
a Get's values are given back to the client (their buffers receive later Gets) only
after the copies reading them completed; ``wait_for_save`` returns only after every
save copy completed, and the chunks sent hold the bytes the cache had when the copies
were enqueued.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier.connector.chunks.codec import decode_chunk
from kvtier.connector.kv.layouts import KVContent
from kvtier.connector.kv.plan import StepPlan
from kvtier.connector.kv.streams import CopyStreams, Event, InlineStream, ThreadEvent, ThreadStream
from kvtier.testing.kvengine import KVEngine, load_plan, save_plan
from kvtier.testing.redisprocs import free_port
from kvtier.testing.tierproc import TierProcess

LAYERS, BLOCKS, CHUNK = 4, 16, 4
CONTENT = KVContent("kv", 8, 16, 128, 128, "bfloat16")  # 64 KiB pages: 1 MiB chunks


class Gate:
    """Holds the work of a copy stream: each permit lets one piece of work run."""

    def __init__(self) -> None:
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()

    def __call__(self) -> None:
        while not self._open.is_set():
            if self._permits.acquire(timeout=0.01):
                return

    def let(self, pieces: int = 1) -> None:
        self._permits.release(pieces)

    def open(self) -> None:
        self._open.set()


def gated(loads: Gate | None = None, saves: Gate | None = None) -> CopyStreams:
    return CopyStreams(InlineStream(), ThreadStream("loads", loads), ThreadStream("saves", saves))


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TierProcess]:
    tier = TierProcess.start(tmp_path_factory.mktemp("tier"), "--data-port", str(free_port()))
    yield tier
    tier.stop()


@pytest.fixture
def engines(tier: TierProcess) -> Iterator[list[KVEngine]]:
    started: list[KVEngine] = []
    yield started
    for engine in started:
        engine.close()


def engine(
    tier: TierProcess,
    engines: list[KVEngine],
    order: str = "LBNHC",
    streams: CopyStreams | None = None,
    content: KVContent = CONTENT,
    **config: object,
) -> KVEngine:
    config = {"load_timeout_s": 30.0, "save_timeout_s": 30.0, **config}  # a busy machine
    made = KVEngine(
        tier.target, order, content, layers=LAYERS, blocks=BLOCKS, chunk_blocks=CHUNK,
        streams=streams or gated(), **config,
    )  # fmt: skip
    engines.append(made)
    return made


def saved(source: KVEngine, *chunks: tuple[bytes, list[int]]) -> None:
    """``source`` saves the chunks (its blocks as they are) and the tier has them."""
    before = source.recorder.totals().get("saved_chunks", 0)
    assert source.step(save_plan(*chunks)) == set()
    assert source.worker.sender.flush(30.0)
    assert source.recorder.totals().get("saved_chunks", 0) == before + len(chunks)


def stored_payload(target: KVEngine, key: bytes) -> torch.Tensor:
    (blob,) = target.client.get([key])
    assert blob is not None
    chunk = decode_chunk(key, blob)
    data = torch.frombuffer(bytearray(chunk.payload), dtype=torch.bfloat16)
    return data.view(chunk.shape)


def test_chunks_saved_layer_by_layer_load_into_another_layout_byte_for_byte(
    tier: TierProcess, engines: list[KVEngine]
) -> None:
    a = engine(tier, engines, "LBNHC")  # FlashAttention's order
    b = engine(tier, engines, "LBHNC")  # FlashInfer's
    values = a.fill(seed=1)
    k1, k2 = os.urandom(32), os.urandom(32)
    saved(a, (k1, [3, 7, 1, 12]), (k2, [5, 6, 2, 0]))

    failed = b.step(load_plan((k1, [8, 9, 10, 11]), (k2, [0, 1, 2, 3])))

    assert failed == set()
    assert torch.equal(b.blocks([8, 9, 10, 11]), values[:, [3, 7, 1, 12]])
    assert torch.equal(b.blocks([0, 1, 2, 3]), values[:, [5, 6, 2, 0]])
    assert not b.blocks([4, 5, 6, 7, 12, 13, 14, 15]).any()


def test_wait_for_layer_load_returns_only_once_that_layers_copies_ran(
    tier: TierProcess, engines: list[KVEngine]
) -> None:
    a = engine(tier, engines)
    values = a.fill(seed=2)
    key = os.urandom(32)
    saved(a, (key, [0, 1, 2, 3]))
    gate = Gate()
    b = engine(tier, engines, "LBHNC", gated(loads=gate))
    plan = load_plan((key, [4, 5, 6, 7]))

    b.worker.start_load_kv(plan)  # returns with every copy still held
    assert not torch.stack(b.caches).any()
    gate.let(2)  # preparing the step's loads, then layer 0's copies
    b.worker.wait_for_layer_load(b.names[0])
    assert torch.equal(b.blocks([4, 5, 6, 7])[0], values[0, :4])
    assert not b.caches[1].any()  # layer 1's copies are still held

    waiter = threading.Thread(target=b.worker.wait_for_layer_load, args=(b.names[1],))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # it cannot return before layer 1's copies ran
    gate.let()
    waiter.join(10.0)
    assert not waiter.is_alive()
    assert torch.equal(b.blocks([4, 5, 6, 7])[1], values[1, :4])

    gate.open()  # the rest of the step
    for name in b.names:
        b.worker.wait_for_layer_load(name)
    b.worker.wait_for_save(plan)
    assert torch.equal(b.blocks([4, 5, 6, 7]), values[:, :4])


def gpu_like(compute: Gate | None = None, loads: Gate | None = None) -> CopyStreams:
    """Streams where the compute stream is a thread too: like a CUDA stream, its ``wait``
    holds later compute work without blocking the caller, so vLLM's calls return while
    copies are still running (what the engine's thread sees on a GPU)."""
    return CopyStreams(
        ThreadStream("compute", compute), ThreadStream("loads", loads), ThreadStream("saves")
    )


def test_a_loads_receive_buffer_is_not_reused_before_its_copies_completed(
    tier: TierProcess, engines: list[KVEngine]
) -> None:
    a = engine(tier, engines)
    values = a.fill(seed=3)
    first, second = os.urandom(32), os.urandom(32)
    saved(a, (first, [0, 1, 2, 3]), (second, [8, 9, 10, 11]))
    gate = Gate()
    streams = gpu_like(loads=gate)
    b = engine(tier, engines, "LBNHC", streams)
    warm = b.client.get([first])  # a buffer of the chunks' size, given back to the client
    buffer = id(memoryview(warm[0]).obj)  # type: ignore[arg-type]
    assert b.client.recycle(warm) == 1

    assert b.step(load_plan((first, [4, 5, 6, 7]))) == set()  # returns, copies still held
    (other,) = b.client.get([second])  # another Get of the same size meanwhile
    assert other is not None and id(memoryview(other).obj) != buffer
    del other
    gate.open()
    streams.compute.record().synchronize()  # the forward ran: it waited for every copy

    assert torch.equal(b.blocks([4, 5, 6, 7]), values[:, :4])  # not the other chunk's bytes
    assert b.step(StepPlan()) == set()  # the next step gives back what completed
    (again,) = b.client.get([second])
    assert again is not None and id(memoryview(again).obj) == buffer


def test_loads_wait_for_the_compute_work_enqueued_before_them(
    tier: TierProcess, engines: list[KVEngine]
) -> None:
    a = engine(tier, engines)
    values = a.fill(seed=10)
    key = os.urandom(32)
    saved(a, (key, [0, 1, 2, 3]))
    gate = Gate()
    streams = gpu_like(compute=gate)
    b = engine(tier, engines, "LBHNC", streams)
    b.fill(seed=11)
    target = torch.tensor([4, 5, 6, 7])
    # The last step's work on these blocks (vLLM zeroes newly allocated blocks), not run yet.
    streams.compute.run(lambda: [layer.index_fill_(0, target, 0) for layer in b.caches])

    assert b.step(load_plan((key, target.tolist()))) == set()
    loaded = streams.loads.record()
    assert isinstance(loaded, ThreadEvent)
    assert not loaded.wait(0.3)  # the loads wait behind the held compute work
    gate.open()
    streams.compute.record().synchronize()

    assert torch.equal(b.blocks(target.tolist()), values[:, :4])  # loaded after the zeroing


def test_wait_for_save_returns_only_once_every_save_copy_completed(
    tier: TierProcess, engines: list[KVEngine]
) -> None:
    gate = Gate()
    a = engine(tier, engines, "BLHNC", gated(saves=gate))  # cross-layer
    values = a.fill(seed=4)
    key = os.urandom(32)
    plan = save_plan((key, [9, 3, 14, 6]))

    stepping = threading.Thread(target=a.step, args=(plan,))
    stepping.start()
    stepping.join(0.3)
    assert stepping.is_alive()  # held in wait_for_save: the copies cannot run
    gate.open()
    stepping.join(10.0)
    assert not stepping.is_alive()
    for layer in a.caches:  # the next step overwrites the blocks: the chunk is already out
        layer.zero_()
    assert a.worker.sender.flush(30.0)

    assert torch.equal(stored_payload(a, key), values[:, [9, 3, 14, 6]])


def test_saves_read_each_layer_after_its_compute_and_cover_layers_vllm_skipped(
    tier: TierProcess, engines: list[KVEngine]
) -> None:
    a = engine(tier, engines, "LBHNC", gated(saves=None))
    a.fill(seed=5)
    key = os.urandom(32)
    plan = save_plan((key, [1, 2, 3, 4]))
    written = torch.randint(0, 250, (LAYERS, CHUNK, 8, 16, 256)).to(torch.bfloat16)
    index = torch.tensor([1, 2, 3, 4])

    a.worker.start_load_kv(plan)
    for layer, name in enumerate(a.names):
        a.caches[layer].index_copy_(0, index, written[layer])  # the layer's forward writes KV
        if layer != 2:  # a layer whose save_kv_layer vLLM never called
            a.worker.save_kv_layer(name, plan)
    a.worker.wait_for_save(plan)
    assert a.worker.sender.flush(30.0)

    assert torch.equal(stored_payload(a, key), written)


def test_a_layers_save_copies_wait_for_the_compute_that_writes_it(
    tier: TierProcess, engines: list[KVEngine]
) -> None:
    gate = Gate()
    streams = gpu_like(compute=gate)
    a = engine(tier, engines, "LBNHC", streams)
    a.fill(seed=12)
    key = os.urandom(32)
    plan = save_plan((key, [8, 9, 10, 11]))
    written = torch.randint(0, 250, (LAYERS, CHUNK, 8, 16, 256)).to(torch.bfloat16)
    index = torch.tensor([8, 9, 10, 11])

    def forward() -> None:
        a.worker.start_load_kv(plan)
        for layer, name in enumerate(a.names):
            a.worker.wait_for_layer_load(name)
            # The layer's attention writes its KV on the compute stream (held by the gate).
            streams.compute.run(lambda layer=layer: a.caches[layer].index_copy_(0, index, written[layer]))
            a.worker.save_kv_layer(name, plan)
        a.worker.wait_for_save(plan)

    stepping = threading.Thread(target=forward)
    stepping.start()
    stepping.join(0.3)
    assert stepping.is_alive()  # the save copies wait behind the held compute work
    gate.open()
    stepping.join(10.0)
    assert not stepping.is_alive() and a.worker.sender.flush(30.0)

    assert torch.equal(stored_payload(a, key), written)


def test_without_layerwise_start_load_kv_leaves_every_layer_loaded(
    tier: TierProcess, engines: list[KVEngine]
) -> None:
    a = engine(tier, engines)
    values = a.fill(seed=6)
    key = os.urandom(32)
    saved(a, (key, [12, 13, 14, 15]))
    b = engine(tier, engines, "LBHNC", layerwise=False)
    assert not b.worker.layerwise

    b.worker.start_load_kv(load_plan((key, [0, 1, 2, 3])))

    assert torch.equal(b.blocks([0, 1, 2, 3]), values[:, 12:])


def test_steps_with_loads_and_saves_under_random_copy_delays_move_every_byte(
    tier: TierProcess, engines: list[KVEngine]
) -> None:
    rng = random.Random(7)

    def jitter() -> None:
        time.sleep(rng.random() * 0.004)

    a = engine(tier, engines, "BLNHC", CopyStreams.threads(jitter))
    b = engine(tier, engines, "LHBNC", CopyStreams.threads(jitter))
    values = a.fill(seed=8)
    keys = [os.urandom(32) for _ in range(4)]
    for step in range(4):  # a saves chunk `step`, b loads it and the one before
        blocks = [(4 * step + i) % BLOCKS for i in range(CHUNK)]
        saved(a, (keys[step], blocks))
        chunks = range(max(0, step - 1), step + 1)
        loads = [(keys[i], [(4 * i + 4 + j) % BLOCKS for j in range(CHUNK)]) for i in chunks]
        assert b.step(load_plan(*loads, req_id=f"r{step}")) == set()
        for i, (_, target) in zip(chunks, loads, strict=True):
            source = [(4 * i + j) % BLOCKS for j in range(CHUNK)]
            assert torch.equal(b.blocks(target), values[:, source])


def test_a_chunk_of_another_shape_fails_its_blocks_and_writes_nothing(
    tier: TierProcess, engines: list[KVEngine]
) -> None:
    other = KVContent("kv", 4, 16, 128, 128, "bfloat16")
    a = engine(tier, engines, content=other)
    a.fill(seed=9)
    key = os.urandom(32)
    saved(a, (key, [0, 1, 2, 3]))
    b = engine(tier, engines)

    failed = b.step(load_plan((key, [4, 5, 6, 7])))

    assert failed == {4, 5, 6, 7}
    assert not torch.stack(b.caches).any()
    assert b.recorder.totals()["corrupt_chunks:shape"] == 1


def test_an_empty_step_enqueues_nothing_and_returns(
    tier: TierProcess, engines: list[KVEngine]
) -> None:
    gate = Gate()  # never opened: any copy would hang the step
    a = engine(tier, engines, streams=gated(gate, gate))
    assert a.step(StepPlan()) == set()


class FailingRun:
    """A copy stream whose ``run`` raises at its ``fail_at``-th call, in the caller, as a
    CUDA stream does when enqueueing a layer's copies cannot allocate their staging
    tensor on the device; everything else is ``inner``'s."""

    def __init__(self, inner: ThreadStream, fail_at: int) -> None:
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def run(self, work: Callable[[], object]) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("CUDA out of memory (simulated while enqueueing a layer's copies)")
        self.inner.run(work)

    def record(self) -> Event:
        return self.inner.record()

    def wait(self, event: Event) -> None:
        self.inner.wait(event)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("fail_at", [1, 3], ids=["at-prepare", "at-layer-1"])
def test_a_load_that_fails_half_enqueued_fails_its_blocks_and_every_layer_wait_returns(
    tier: TierProcess, engines: list[KVEngine], monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    # The worker logs the failure with its traceback, whose frames hold the load's values:
    # pytest's log capture keeps such records for its report (no handler of an engine
    # does), which would keep the buffer from its pool.
    monkeypatch.setattr(logging.getLogger("kvtier.connector.kv.worker"), "propagate", False)
    a = engine(tier, engines)
    values = a.fill(seed=12)
    first, second = os.urandom(32), os.urandom(32)
    saved(a, (first, [0, 1, 2, 3]), (second, [8, 9, 10, 11]))
    gate = Gate()
    # Run 1 prepares the step's loads (nothing enqueued reads the values when it fails),
    # run 2 is layer 0's copies, run 3 layer 1's (layer 0's copies are enqueued then).
    loads = FailingRun(ThreadStream("loads", gate), fail_at=fail_at)
    b = engine(tier, engines, "LBNHC", CopyStreams(InlineStream(), loads, ThreadStream("saves")))
    warm = b.client.get([first])  # a buffer of the chunks' size, for the load to receive into
    buffer = id(memoryview(warm[0]).obj)  # type: ignore[arg-type]
    assert b.client.recycle(warm) == 1

    opener = threading.Timer(0.3, gate.open)  # the copies enqueued before the failure run late
    opener.start()
    try:
        failed = b.step(load_plan((first, [4, 5, 6, 7])))  # every layer's wait, as vLLM's forward
    finally:
        opener.cancel()
        gate.open()

    assert failed == {4, 5, 6, 7}  # recomputed by vLLM, never read as loaded
    # The load's buffer is given back once the copies enqueued before the failure ran:
    # by the next step (the layer waits above waited for them), and a Get of that size
    # then receives into it.
    assert b.step(StepPlan()) == set()
    (again,) = b.client.get([second])
    assert again is not None and id(memoryview(again).obj) == buffer
    del again
    # The engine goes on: the next step's load lands whole.
    assert b.step(load_plan((second, [12, 13, 14, 15]))) == set()
    assert torch.equal(b.blocks([12, 13, 14, 15]), values[:, [8, 9, 10, 11]])
