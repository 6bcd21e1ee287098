"""Real faults of the tier process and of its disk, under real vLLM engines with requests
in flight (issue 21, item 2).

Engine W (relaxed deadlines) computes every prompt first, a no-cache run: its output is
the reference. Engine F (short deadlines, ``FAST_FAULTS``) is the engine most faults
strike (W, when the tier dies under its saves). The engine a fault strikes is on the
tier's data port when it strikes (``on_data_port`` waits for that: an engine that could
not connect to the data port uses gRPC for ``DATA_RETRY_S``, so the tests that kill the
tier come last). The tier keeps 1 MiB of RAM, so most Gets read chunks from its disk.

The faults, each at the moment its name says: the tier SIGKILLed while chunks are being
loaded (as soon as it has sent the first bytes of the step's loads) and while they are
being saved (as soon as it has received the first saved chunk); the tier restarted on
the same disk directory in the middle of a batch that loads and saves; its disk filling
up, and its disk becoming read-only, while the engines save; and, with an engine whose
KV cache holds two requests (S), vLLM preempting requests whose KV it loaded. Every request
must be answered with the no-cache output, nothing corrupt may be served, and no call
may wait longer than the deadlines allow. Each test adds a row to the fault table
(tests/e2e/faultreport.py).
"""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from kvtier.connector.client.tierclient import DATA_RETRY_S
from kvtier.testing.engine import EngineProcess, Output
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import prompt_text
from tests.e2e.conftest import FAST_FAULTS, RELAXED
from tests.e2e.faultreport import record

pytestmark = pytest.mark.vllm

CHUNK = 256
PROMPT_WORDS = 330  # about 960 tokens: 3 full chunks, then a partial one
FULL = 3
BATCH = 8
SEEDS = itertools.count(500)
DATA_PORT = "data port"


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tier(module_dir: Path) -> Iterator[TierProcess]:
    tier = TierProcess.start(module_dir / "tier", "--ram-bytes", "1MiB")  # data port on
    yield tier
    tier.stop()


@pytest.fixture(scope="module")
def engines(
    text_model: Path, tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> tuple[EngineProcess, EngineProcess, EngineProcess]:
    """W, F and S (a KV cache of 17 blocks of 128 tokens), started side by side."""
    config = {"target": tier.target, **RELAXED}
    w = start_engine(text_model, name="w", extra_config=config, wait=False)
    f = start_engine(text_model, name="f", extra_config={**config, **FAST_FAULTS}, wait=False)
    s = start_engine(
        text_model, name="s", extra_config=config, wait=False,
        llm_kwargs={"num_gpu_blocks_override": 17, "max_model_len": 2048},
    )  # fmt: skip
    for engine in (w, f, s):
        engine.wait_ready()
    return w, f, s


@pytest.fixture(scope="module")
def writer(engines: tuple[EngineProcess, ...]) -> EngineProcess:
    return engines[0]


@pytest.fixture(scope="module")
def faulty(engines: tuple[EngineProcess, ...]) -> EngineProcess:
    return engines[1]


@pytest.fixture
def healthy(tier: TierProcess, writer: EngineProcess, faulty: EngineProcess) -> None:
    """The tier runs and F loads from it again (breaker closed, connections back)."""
    if tier.proc is None or tier.proc.poll() is not None:
        tier.restart()
    reaches_tier(writer, faulty)


# -- helpers --------------------------------------------------------------------------


def prompts(n: int) -> list[dict[str, str]]:
    return [{"prompt": prompt_text(PROMPT_WORDS, seed=next(SEEDS))} for _ in range(n)]


def salted(batch: list[dict[str, str]], salt: str) -> list[dict[str, str]]:
    return [{**p, "cache_salt": salt} for p in batch]


def tokens(outputs: list[Output]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def computed(engine: EngineProcess, batch: list[dict[str, str]]) -> list[list[int]]:
    """``engine`` computes ``batch`` (none of it in the tier: a no-cache run) and saves it."""
    outs = engine.generate(batch)
    assert all(o.num_cached_tokens == 0 for o in outs)
    engine.flush()
    return tokens(outs)


def reaches_tier(writer: EngineProcess, faulty: EngineProcess) -> None:
    """Until F loads a prompt W saved (after a fault: breaker closed, connections back).

    Proven by F's worker loading the chunks, not by ``num_cached_tokens``: vLLM sets that
    from the scheduler's Lookup when it schedules the request and keeps it when the
    worker's load then fails or is skipped (an open breaker) and the chunks are recomputed.
    """
    deadline = time.monotonic() + 30
    while True:
        probe = prompts(1)
        computed(writer, probe)
        before = faulty.stats()
        hit = faulty.generate(probe)[0].num_cached_tokens == FULL * CHUNK
        if hit and delta(faulty, before, "loaded_chunks") == FULL:
            return
        assert time.monotonic() < deadline, "engine F did not reach the tier again"
        time.sleep(0.2)


def on_data_port(tier: TierProcess, writer: EngineProcess, engine: EngineProcess) -> None:
    """Until ``engine`` (W saving, or F loading) calls the tier over its data port: an
    engine that could not connect to the data port (the tier was down) uses gRPC for
    ``DATA_RETRY_S``, and a fault test strikes an engine on the data port."""
    deadline = time.monotonic() + DATA_RETRY_S + 30
    while True:
        puts, gets = data_calls(tier)
        probe = prompts(1)
        computed(writer, probe)  # W's Put
        if engine is writer:
            if data_calls(tier)[0] > puts:
                return
        elif engine.generate(probe)[0].num_cached_tokens and data_calls(tier)[1] > gets:
            return  # F's Get went over the data port
        assert time.monotonic() < deadline, "the engine did not come back to the data port"
        time.sleep(2)


def data_calls(tier: TierProcess) -> tuple[float, float]:
    """The tier's completed data-port Puts and Gets."""
    return (
        tier.metric("kvtier_server_requests_total", code="OK", op="DataPut"),
        tier.metric("kvtier_server_requests_total", code="OK", op="DataGet"),
    )


def written_behind(tier: TierProcess) -> None:
    deadline = time.monotonic() + 30
    while tier.metric("kvtier_write_behind_queue_depth") > 0:
        assert time.monotonic() < deadline, "the write-behind queue never drained"
        time.sleep(0.05)


def delta(engine: EngineProcess, before: dict[str, float], name: str) -> float:
    return engine.stats().get(name, 0) - before.get(name, 0)


def corrupt(stats: dict[str, float]) -> float:
    return sum(v for k, v in stats.items() if k.startswith("corrupt_chunks"))


def sigkill(tier: TierProcess) -> None:
    """SIGKILL, where the tier stands (``TierProcess.kill`` sends SIGCONT first)."""
    assert tier.proc is not None
    tier.proc.kill()
    tier.proc.wait(10)


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


class WhenTierMetricGrows(threading.Thread):
    """Runs ``action`` once, as soon as the tier's counter ``metric`` grows past its value
    at start (polled every few milliseconds). Used as a context manager around traffic."""

    def __init__(self, tier: TierProcess, metric: str, action: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self.tier, self.metric, self.action = tier, metric, action
        self.start_value = tier.metric(metric)
        self.fired = threading.Event()
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            try:
                value = self.tier.metric(self.metric)
            except OSError:
                return
            if value > self.start_value:
                try:
                    self.action()
                except BaseException as e:  # reported by __exit__, in the test's thread
                    self.error = e
                    return
                self.fired.set()
                return
            time.sleep(0.002)

    def __enter__(self) -> WhenTierMetricGrows:
        self.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._done.set()
        self.join(60)
        if self.error is not None and exc[0] is None:
            raise AssertionError(f"the fault's action failed: {self.error!r}") from self.error


# -- the tier's disk --------------------------------------------------------------------


@pytest.fixture
def small_disk(tier: TierProcess) -> Iterator[TierProcess]:
    """The tier restarted with its disk tier on a 2 MiB tmpfs (15 chunks), then back."""
    tier.disk_fs_bytes = 2 << 20
    tier.restart()
    yield tier
    with contextlib.suppress(RuntimeError):  # the tier may be gone: its restart remounts
        remount(tier, "rw", within_s=2)
    tier.disk_fs_bytes = 0
    tier.restart()


def remount(tier: TierProcess, mode: str, *, within_s: float = 10.0) -> None:
    """Remounts the tier's disk tmpfs ``ro`` or ``rw`` (in its namespaces).

    The kernel refuses a read-only remount (EBUSY) while any file on it is open for writing,
    which is the case for the few milliseconds a write-behind copy writes its file: retried
    until it takes, within ``within_s``; the last refusal is raised with mount's own words.
    """
    assert tier.proc is not None
    command = [
        "nsenter", "-t", str(tier.proc.pid), "-U", "-m", "--preserve-credentials",
        "mount", "-o", f"remount,{mode}", str(tier.directory / "disk"),
    ]  # fmt: skip
    deadline = time.monotonic() + within_s
    while True:
        done = subprocess.run(command, check=False, capture_output=True, text=True)
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"remount,{mode} of the tier's disk failed: {done.stderr.strip()}")
        time.sleep(0.005)


def test_disk_filling_up_while_engines_save_answers_every_request_with_the_no_cache_output(
    writer: EngineProcess, faulty: EngineProcess, small_disk: TierProcess, healthy: None
) -> None:
    tier = small_disk
    on_data_port(tier, writer, faulty)
    batch = prompts(2 * BATCH)  # 48 chunks for a disk that holds 15
    expected, computing_s = timed(lambda: computed(writer, salted(batch, "reference")))
    before = faulty.stats()

    outs, elapsed = timed(lambda: faulty.generate(batch))  # F computes and saves
    faulty.flush()
    written_behind(tier)

    assert tokens(outs) == expected
    assert delta(faulty, before, "saved_chunks") == 2 * BATCH * FULL  # RAM took every one
    assert "capacity lowered" in tier.log.read_text()
    assert tier.metric("kvtier_tier_healthy", tier="disk") == 1  # full is not failing
    bound = computing_s + 10
    assert elapsed < bound

    # The newest chunks stay, whole: the last 4 prompts' 12 chunks fill the 1 MiB of RAM
    # (7) and the newest of the disk's 15; the disk serves the older ones.
    disk_hits = tier.metric("kvtier_tier_hits_total", tier="disk")
    again = faulty.generate(batch[-4:])
    assert tokens(again) == expected[-4:]
    assert [o.num_cached_tokens for o in again] == [FULL * CHUNK] * 4
    assert tier.metric("kvtier_tier_hits_total", tier="disk") > disk_hits
    assert corrupt(faulty.stats()) == corrupt(before)
    assert tier.metric("kvtier_tier_verification_failures_total", tier="disk") == 0
    record(
        "tier's disk fills up while engines save", DATA_PORT, tokens(outs), expected, elapsed, bound
    )


def test_disk_made_read_only_while_engines_save_answers_every_request_and_recovers(
    writer: EngineProcess, faulty: EngineProcess, small_disk: TierProcess, healthy: None
) -> None:
    tier = small_disk
    on_data_port(tier, writer, faulty)
    batch = prompts(BATCH)
    expected, computing_s = timed(lambda: computed(writer, salted(batch, "reference")))
    before = faulty.stats()

    def read_only() -> None:
        remount(tier, "ro")

    with WhenTierMetricGrows(tier, "kvtier_server_received_bytes_total", read_only) as fault:
        outs, elapsed = timed(lambda: faulty.generate(batch))  # F computes and saves
        faulty.flush()
    written_behind(tier)

    assert fault.fired.is_set()
    assert tokens(outs) == expected
    assert delta(faulty, before, "saved_chunks") == BATCH * FULL  # RAM took every one
    assert tier.metric("kvtier_tier_errors_total", tier="disk", op="put") >= 1
    assert tier.metric("kvtier_tier_healthy", tier="disk") == 0
    bound = computing_s + 10
    assert elapsed < bound

    remount(tier, "rw")
    deadline = time.monotonic() + 30
    while tier.metric("kvtier_tier_healthy", tier="disk") != 1:  # the prober brings it back
        assert time.monotonic() < deadline, "the disk tier did not recover"
        time.sleep(0.2)
    again = faulty.generate(batch)
    assert tokens(again) == expected
    assert corrupt(faulty.stats()) == corrupt(before)
    record(
        "tier's disk made read-only while engines save",
        DATA_PORT,
        tokens(outs),
        expected,
        elapsed,
        bound,
    )


# -- vLLM preempting loaded requests ---------------------------------------------------

PREEMPT_TOKENS = 160  # 960 + 160 tokens cross a block boundary (128) while decoding


def test_requests_preempted_after_their_load_are_loaded_again_with_the_no_cache_output(
    writer: EngineProcess, engines: tuple[EngineProcess, ...], healthy: None
) -> None:
    # S holds 17 blocks of 128 tokens: two prompts of 8 blocks run at once, and the first
    # that needs a ninth block while decoding takes it from the other, which vLLM preempts
    # (frees its blocks) and later admits again: the connector loads its chunks again,
    # into other blocks.
    small = engines[2]
    batch = prompts(4)
    outs_w = writer.generate(batch, max_tokens=PREEMPT_TOKENS)
    writer.flush()
    expected = tokens(outs_w)
    before = small.stats()

    outs, elapsed = timed(lambda: small.generate(batch, max_tokens=PREEMPT_TOKENS))

    assert tokens(outs) == expected
    loaded = delta(small, before, "loaded_chunks")
    assert loaded > len(batch) * FULL, f"no request was preempted and loaded again ({loaded})"
    assert delta(small, before, "load_failed_blocks") == 0
    # No deadline: vLLM runs two requests at a time and recomputes what it preempted.
    record("vLLM preempts requests whose KV it loaded", DATA_PORT, tokens(outs), expected,
           elapsed, None)  # fmt: skip


# -- the tier process -------------------------------------------------------------------


def test_tier_sigkilled_while_chunks_load_answers_every_request_with_the_no_cache_output(
    writer: EngineProcess, faulty: EngineProcess, tier: TierProcess, healthy: None
) -> None:
    on_data_port(tier, writer, faulty)
    batch = prompts(BATCH)
    expected, computing_s = timed(lambda: computed(writer, batch))
    written_behind(tier)
    before = faulty.stats()

    with WhenTierMetricGrows(tier, "kvtier_server_sent_bytes_total", lambda: sigkill(tier)) as kill:
        outs, elapsed = timed(lambda: faulty.generate(batch))

    assert kill.fired.is_set(), "the tier sent nothing: F loaded nothing"
    assert delta(faulty, before, "errors:load") >= 1, "no load was in flight when the tier died"
    assert delta(faulty, before, "loaded_chunks") < BATCH * FULL
    assert tokens(outs) == expected
    bound = computing_s + FAST_FAULTS["load_timeout_s"] + 10
    assert elapsed < bound
    record("tier SIGKILLed while chunks load", DATA_PORT, tokens(outs), expected, elapsed, bound)


def test_tier_sigkilled_while_chunks_save_answers_every_request_and_serves_no_partial_chunk(
    writer: EngineProcess, faulty: EngineProcess, tier: TierProcess, healthy: None
) -> None:
    # W is the engine saving here (F, struck by the previous test, may still be on gRPC):
    # F computes the reference, W computes the batch again and saves it.
    on_data_port(tier, writer, writer)
    batch = prompts(BATCH)
    expected, computing_s = timed(lambda: computed(faulty, salted(batch, "reference")))
    before = writer.stats()

    with WhenTierMetricGrows(
        tier, "kvtier_server_received_bytes_total", lambda: sigkill(tier)
    ) as kill:
        outs, elapsed = timed(lambda: writer.generate(batch))  # W computes and saves
        writer.flush()

    assert kill.fired.is_set(), "the tier received nothing: W saved nothing"
    assert delta(writer, before, "saves_dropped:tier_down") >= 1, (
        f"no save was in flight when the tier died: {writer.stats()}"
    )
    assert delta(writer, before, "saved_chunks") < BATCH * FULL
    assert tokens(outs) == expected
    bound = computing_s + 10  # saves never hold the engine up
    assert elapsed < bound

    # Restarted on the same disk: whatever of the batch was stored is served whole.
    tier.restart()
    reaches_tier(writer, faulty)
    before = faulty.stats()
    again = faulty.generate(batch)
    assert tokens(again) == expected
    assert corrupt(faulty.stats()) == corrupt(before)
    assert tier.metric("kvtier_tier_verification_failures_total", tier="disk") == 0
    record("tier SIGKILLed while chunks save", DATA_PORT, tokens(outs), expected, elapsed, bound)


def test_tier_restarted_on_its_disk_mid_traffic_answers_every_request_and_hits_from_disk(
    writer: EngineProcess, faulty: EngineProcess, tier: TierProcess, healthy: None
) -> None:
    on_data_port(tier, writer, faulty)
    stored = prompts(BATCH)
    stored_expected = computed(writer, stored)
    # Stored too, and sent again only after the restart: then nothing (no recompute during
    # the fault) has put their chunks into the new tier's RAM, so only its disk serves them.
    kept = prompts(BATCH)
    kept_expected = computed(writer, kept)
    written_behind(tier)  # on disk: they must survive the restart
    fresh = prompts(BATCH)
    fresh_expected, computing_s = timed(lambda: computed(writer, salted(fresh, "reference")))
    before = faulty.stats()

    # F loads the stored prompts and computes (and saves) the fresh ones in one batch; the
    # tier is SIGKILLed and started again on its disk directory once it has sent a chunk.
    with WhenTierMetricGrows(tier, "kvtier_server_sent_bytes_total", tier.restart) as restart:
        outs, elapsed = timed(lambda: faulty.generate(stored + fresh))
        faulty.flush()

    assert restart.fired.is_set()
    assert tokens(outs) == stored_expected + fresh_expected
    bound = 2 * computing_s + FAST_FAULTS["load_timeout_s"] + 10
    assert elapsed < bound

    reaches_tier(writer, faulty)
    disk_hits = tier.metric("kvtier_tier_hits_total", tier="disk")
    loads = faulty.stats()
    again = faulty.generate(kept)
    assert [o.num_cached_tokens for o in again] == [FULL * CHUNK] * BATCH
    assert delta(faulty, loads, "loaded_chunks") == BATCH * FULL  # loaded, not recomputed
    assert tokens(again) == kept_expected
    assert tier.metric("kvtier_tier_hits_total", tier="disk") - disk_hits >= BATCH * FULL
    assert corrupt(faulty.stats()) == corrupt(before)
    record(
        "tier restarted on its disk directory mid-traffic",
        DATA_PORT,
        tokens(outs),
        stored_expected + fresh_expected,
        elapsed,
        bound,
    )
