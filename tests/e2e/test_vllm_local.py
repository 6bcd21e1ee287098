"""Two vLLM processes on the tier's node: every save and load through the same-node transport.

Engine A computes and saves through the tier's Unix socket and shared memory; engine B,
a separate process, loads the same way; a run with a fresh ``cache_salt`` is the
no-cache reference. The tier's metrics show that no chunk went over TCP. After a
restart of the tier, chunks the disk tier kept are loaded from their record files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.testing.engine import EngineProcess
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import prompt_text
from kvtier.testing.waits import wait_for
from tests.e2e.conftest import RELAXED

pytestmark = pytest.mark.vllm

CHUNK = 256
PROMPT_WORDS = 330  # about 960 tokens: 3 full chunks of 256, then a partial one
REQUESTS = "kvtier_server_requests_total"


@pytest.fixture(scope="module")
def tier(module_dir: Path) -> Iterator[TierProcess]:
    tier = TierProcess.start(module_dir / "tier", local_socket=True, data_port=True)
    yield tier
    tier.stop()


@pytest.fixture(scope="module")
def engines(
    text_model: Path, tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> tuple[EngineProcess, EngineProcess]:
    config = {"target": tier.target, "local_socket": tier.local_socket, "chunk_size": CHUNK, **RELAXED}
    a = start_engine(text_model, name="a", extra_config=config, wait=False)
    b = start_engine(text_model, name="b", extra_config=config, wait=False)
    a.wait_ready()
    b.wait_ready()
    return a, b


def test_an_engine_loads_what_another_saved_through_shared_memory_with_identical_output(
    engines: tuple[EngineProcess, EngineProcess], tier: TierProcess
) -> None:
    a, b = engines
    prompt = prompt_text(PROMPT_WORDS, seed=11)
    (first,) = a.generate([{"prompt": prompt}])
    assert first.num_cached_tokens == 0
    a.flush()

    (second,) = b.generate([{"prompt": prompt}])
    (reference,) = b.generate([{"prompt": prompt, "cache_salt": "reference"}])

    assert second.num_prompt_tokens > 3 * CHUNK
    assert second.num_cached_tokens == second.num_prompt_tokens // CHUNK * CHUNK
    assert reference.num_cached_tokens == 0
    assert second.token_ids == first.token_ids == reference.token_ids
    assert tier.metric(REQUESTS, op="LocalPut", code="OK") >= 1
    # one copy: every chunk written straight into memory the tier reserved for it
    assert tier.metric(REQUESTS, op="LocalReserve", code="OK") >= 1
    assert tier.metric(REQUESTS, op="LocalStage", code="OK") == 0
    assert tier.metric(REQUESTS, op="LocalGet", code="OK") >= 1
    assert tier.metric("kvtier_server_sent_bytes_total") > 0
    for op in ("Get", "Put", "DataGet", "DataPut", "Lookup"):  # nothing over TCP
        assert tier.metric(REQUESTS, op=op, code="OK") == 0
    assert tier.metric("kvtier_local_leased_bytes") == 0


def test_after_a_tier_restart_an_engine_loads_chunks_from_their_record_files_with_identical_output(
    engines: tuple[EngineProcess, EngineProcess], tier: TierProcess
) -> None:
    """The RAM tier starts empty after a restart; the disk tier kept the chunks, and a
    same-node client reads each from its record file (the tier hands over the file, never
    reads the value, and does not promote it)."""
    a, b = engines
    prompt = prompt_text(PROMPT_WORDS, seed=23)
    (first,) = a.generate([{"prompt": prompt}])
    assert first.num_cached_tokens == 0
    a.flush()
    full = first.num_prompt_tokens // CHUNK
    assert wait_for(
        lambda: tier.metric("kvtier_write_behind_queue_depth") == 0
        and tier.metric("kvtier_tier_entries", tier="disk") >= full
    )
    tier.restart()
    for seed in (1, 2):  # connections to the tier that went away are dropped on their first call
        b.generate([{"prompt": prompt_text(20, seed=seed), "cache_salt": "warm-up"}])

    (second,) = b.generate([{"prompt": prompt}])

    assert second.num_cached_tokens == full * CHUNK
    assert second.token_ids == first.token_ids
    assert tier.metric("kvtier_tier_hits_total", tier="disk") >= full
    assert tier.metric("kvtier_tier_hits_total", tier="ram") == 0
    assert tier.metric("kvtier_tier_promotions_total", tier="ram") == 0
    for op in ("Get", "DataGet"):  # nothing over TCP
        assert tier.metric(REQUESTS, op=op, code="OK") == 0
