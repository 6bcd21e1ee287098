"""A tier that is absent or frozen, and a connection to it cut or stalled mid-load: every
request completes, by recomputing, with the same output as without a cache, and the
engine never hangs.

Engine W writes straight to the tier. Engine F reaches it through a ``FaultProxy`` (to
cut or stall its connection at an exact byte) with short deadlines (``FAST_FAULTS``):
its gRPC calls and its data-port transfers (the tier runs as deployed, data port on).
The tier's process itself killed mid-load, mid-save or restarted mid-traffic, and its
disk faults: tests/e2e/test_vllm_tier_faults.py.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.connector.client import TierClient
from kvtier.testing.engine import EngineProcess
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import prompt_text
from tests.e2e.conftest import FAST_FAULTS, RELAXED
from tests.e2e.faultproxy import FaultProxy
from tests.e2e.faultreport import record

pytestmark = pytest.mark.vllm

CHUNK = 256
PROMPT_WORDS = 330  # 3 full chunks
CHUNK_BYTES = 131_162  # one chunk of the tiny model on the wire
PROXIED = "data port and gRPC, through a fault proxy"
PROBE_SEEDS = itertools.count(1000)


@pytest.fixture(scope="module")
def proxy(module_tier: TierProcess) -> Iterator[FaultProxy]:
    proxy = FaultProxy(
        ("127.0.0.1", module_tier.port),
        data_upstream=("127.0.0.1", module_tier.data_port),
        host="127.0.0.2",  # the tier listens on 127.0.0.1: its data port's number is free here
    ).listen()
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def engines(
    text_model: Path,
    module_tier: TierProcess,
    proxy: FaultProxy,
    start_engine: Callable[..., EngineProcess],
) -> tuple[EngineProcess, EngineProcess]:
    w_config = {"target": module_tier.target, **RELAXED}
    f_config = {"target": proxy.target, **FAST_FAULTS}
    w = start_engine(text_model, name="w", extra_config=w_config, wait=False)
    f = start_engine(text_model, name="f", extra_config=f_config, wait=False)
    w.wait_ready()
    f.wait_ready()
    return w, f


@pytest.fixture(scope="module")
def writer(engines: tuple[EngineProcess, EngineProcess]) -> EngineProcess:
    """Engine W: talks to the tier directly."""
    return engines[0]


@pytest.fixture(scope="module")
def faulty(engines: tuple[EngineProcess, EngineProcess]) -> EngineProcess:
    """Engine F: talks to the tier through the fault proxy, with short deadlines."""
    return engines[1]


@pytest.fixture
def healthy(module_tier: TierProcess, proxy: FaultProxy, writer, faulty) -> None:
    """Each test starts with the tier up, the proxy passing bytes, and engine F
    loading from the tier again (breaker closed, gRPC reconnected)."""
    if module_tier.proc is None or module_tier.proc.poll() is not None:
        module_tier.restart()
    module_tier.thaw()
    proxy.release()
    if proxy._server is None:
        proxy.listen()
    # A new probe each try: a probe F once computed or loaded would hit F's own prefix
    # cache, without proving that F reaches the tier again (breaker, gRPC reconnect). The
    # proof is F's worker loading chunks: vLLM's num_cached_tokens comes from the
    # scheduler's Lookup and stays when the worker's load is skipped or fails.
    deadline = time.monotonic() + 30
    while True:
        probe, _ = computed_by_writer(writer, seed=next(PROBE_SEEDS))
        before = faulty.stats()
        faulty.generate([probe])
        if delta(faulty, before, "loaded_chunks") > 0:
            break
        assert time.monotonic() < deadline, "engine F did not recover"
        time.sleep(0.2)


def computed_by_writer(writer: EngineProcess, seed: int) -> tuple[dict[str, str], list[int]]:
    prompt = {"prompt": prompt_text(PROMPT_WORDS, seed=seed)}
    (out,) = writer.generate([prompt])
    assert out.num_cached_tokens == 0  # the no-cache reference
    writer.flush()
    return prompt, out.token_ids


def assert_stored(tier: TierProcess, writer: EngineProcess, prompt: dict[str, str]) -> None:
    """All 3 chunks of ``prompt`` are in the tier (so engine F's load is 3 chunks long)."""
    with TierClient(tier.target) as client:
        assert client.lookup(writer.chunk_keys(prompt["prompt"])) == 3


def delta(engine: EngineProcess, before: dict[str, float], name: str) -> float:
    return engine.stats().get(name, 0) - before.get(name, 0)


def test_engine_serves_while_tier_absent(writer, faulty, proxy, healthy) -> None:
    prompt, expected = computed_by_writer(writer, seed=10)
    proxy.close()  # nothing listens on the tier's address
    before = faulty.stats()
    started = time.monotonic()

    outs = faulty.generate([prompt, prompt, prompt])

    elapsed = time.monotonic() - started
    assert [o.token_ids for o in outs] == [expected] * 3
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert delta(faulty, before, "errors:lookup") >= 1
    record("tier absent (nothing listens)", PROXIED, [o.token_ids for o in outs],
           [expected] * 3, elapsed, None)  # fmt: skip


def test_connection_cut_mid_load_recomputes(writer, faulty, proxy, module_tier, healthy) -> None:
    prompt, expected = computed_by_writer(writer, seed=11)
    assert_stored(module_tier, writer, prompt)
    before = faulty.stats()
    proxy.cut_after(CHUNK_BYTES + CHUNK_BYTES // 2)  # in the middle of the second chunk
    started = time.monotonic()

    (out,) = faulty.generate([prompt])

    assert proxy.tripped, f"engine F loaded too little to reach the cut: {faulty.stats()}"
    assert out.token_ids == expected
    assert delta(faulty, before, "load_failed_blocks") == 6  # all 3 chunks of 2 blocks
    assert delta(faulty, before, "errors:load") == 1
    elapsed = time.monotonic() - started
    assert elapsed < 10
    record("connection cut in the middle of a load", PROXIED, [out.token_ids], [expected],
           elapsed, 10)  # fmt: skip


def test_connection_stalled_mid_load_recomputes_within_deadline(
    writer, faulty, proxy, module_tier, healthy
) -> None:
    prompt, expected = computed_by_writer(writer, seed=12)
    assert_stored(module_tier, writer, prompt)
    before = faulty.stats()
    proxy.stall_after(CHUNK_BYTES // 2)
    started = time.monotonic()

    (out,) = faulty.generate([prompt])

    elapsed = time.monotonic() - started
    proxy.release()
    assert out.token_ids == expected
    assert delta(faulty, before, "load_failed_blocks") == 6
    assert elapsed < FAST_FAULTS["load_timeout_s"] + 5
    record("connection stalled in the middle of a load", PROXIED, [out.token_ids], [expected],
           elapsed, FAST_FAULTS["load_timeout_s"] + 5)  # fmt: skip


def test_frozen_tier_opens_breaker_then_probe_closes_it(
    writer, faulty, module_tier, healthy
) -> None:
    prompt, expected = computed_by_writer(writer, seed=13)
    module_tier.freeze()  # SIGSTOP: connections stay open, nothing answers
    before = faulty.stats()
    try:
        started = time.monotonic()
        # One batch: the scheduler looks the requests up one after the other in one step.
        outs = faulty.generate([prompt] * 6)
        elapsed = time.monotonic() - started
    finally:
        module_tier.thaw()

    assert [o.token_ids for o in outs] == [expected] * 6
    failed = delta(faulty, before, "errors:lookup")
    skipped = delta(faulty, before, "calls_skipped:lookup")
    assert failed + skipped == 6
    assert failed >= FAST_FAULTS["breaker_failures"]
    assert skipped >= 1  # the open breaker spared the tier (and the engine) the rest
    assert delta(faulty, before, "breaker_opened") >= 1
    assert faulty.stats()["breaker_open"] >= 1  # the gauge behind the CircuitOpen alert
    assert elapsed < failed * FAST_FAULTS["lookup_timeout_s"] + 10
    record("tier frozen (SIGSTOP), breaker opens", PROXIED, [o.token_ids for o in outs],
           [expected] * 6, elapsed, failed * FAST_FAULTS["lookup_timeout_s"] + 10)  # fmt: skip

    deadline = time.monotonic() + 30
    while True:  # after the cool-down one probe goes through and the loads come back
        time.sleep(FAST_FAULTS["breaker_cooldown_s"])
        # A prompt F never ran: F computed ``prompt`` itself while the tier was frozen.
        probe, probe_expected = computed_by_writer(writer, seed=next(PROBE_SEEDS))
        loads = faulty.stats()
        (out,) = faulty.generate([probe])
        loaded = delta(faulty, loads, "loaded_chunks")
        if loaded or time.monotonic() > deadline:
            break
    assert out.num_cached_tokens == 3 * CHUNK
    assert out.token_ids == probe_expected
    assert loaded == 3  # the worker loaded them (num_cached_tokens is the Lookup's count)
    assert faulty.stats()["breaker_open"] == 0


def test_saves_beyond_the_queue_are_dropped_and_counted_while_the_tier_is_frozen(
    text_model: Path, module_tier: TierProcess, start_engine, writer, healthy
) -> None:
    # A one-chunk save queue: the sender's first Put hangs on the frozen tier until its
    # deadline; every chunk offered meanwhile beyond the one queued is dropped, not waited for.
    config = {"target": module_tier.target, **FAST_FAULTS, "save_queue_chunks": 1,
              "save_batch_chunks": 1}  # fmt: skip
    saver = start_engine(text_model, name="q", extra_config=config)
    prompts = [computed_by_writer(writer, seed=20 + i) for i in range(4)]
    module_tier.freeze()
    try:
        outs = saver.generate([prompt for prompt, _ in prompts])
        stats = saver.stats()
    finally:
        module_tier.thaw()

    assert [o.token_ids for o in outs] == [expected for _, expected in prompts]
    # 12 chunks offered; at most one more fits each time a Put gives up (2 s deadline).
    assert stats.get("saves_dropped:queue_full", 0) >= 6
    assert stats.get("saved_chunks", 0) == 0


def test_engine_started_while_no_tier_listens_serves_every_request_by_recomputing(
    text_model: Path, start_engine, writer, healthy
) -> None:
    from kvtier.testing.redisprocs import free_port

    config = {"target": f"127.0.0.1:{free_port()}", **FAST_FAULTS}  # nothing listens there
    engine = start_engine(text_model, name="no-tier", extra_config=config)
    prompt, expected = computed_by_writer(writer, seed=30)

    outs = engine.generate([prompt, prompt])

    assert [o.token_ids for o in outs] == [expected, expected]
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert engine.stats().get("errors:lookup", 0) >= 1
    assert "not reachable at start" in engine.log.read_text()
