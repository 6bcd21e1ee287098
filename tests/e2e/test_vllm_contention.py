"""Loads and saves under deliberate CPU contention (issue 21, defect 1).

A loaded machine deschedules every thread at arbitrary points: the engine between
receiving a chunk and copying it into the KV cache, the background sender while it
encodes a chunk copied out of the KV cache, the tier while it sends a value that a Put
is replacing. Whatever the interleaving, an engine must hand vLLM exactly the KV another
engine saved, or recompute.

Two engine processes share one tier, over its data port: A stores zstd chunks and B raw
ones, and each loads what the other saved. The saving engine's run of a prompt is a
no-cache run (nothing of it is in the tier yet): the reference for the loading run.
Chunks are 2,048 tokens of the 2-layer model, 1 MiB raw, so both ends receive values
into recycled buffers: an engine loading raw chunks into buffers of chunks it loaded
before, the tier (24 MiB of RAM, so it evicts all the time) into buffers of values it
evicted. Busy processes, two per CPU, compete with the engines and the tier for every
round; each round sends a batch of prompts (several loads and saves in the same steps)
in one direction, the next round in the other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.proto.buffers import POISON_ENV
from kvtier.testing.contention import busy_count, busy_cpus
from kvtier.testing.engine import EngineProcess, Output
from kvtier.testing.redisprocs import free_port
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import prompt_text
from tests.e2e.conftest import RELAXED

pytestmark = pytest.mark.vllm

CHUNK = 2048  # 2 layers x 2,048 tokens x 1 KV head x 128 x 2 bytes: 1 MiB a chunk
PROMPT_WORDS = 2250  # about 6,500 tokens: 3 full chunks, then a partial one
FULL_CHUNKS = 3
PROMPTS_PER_ROUND = 3
ROUNDS = 6
ENGINE_ARGS = {"max_model_len": 8192}


@pytest.fixture(scope="module", autouse=True)
def poisoned_recycling() -> Iterator[None]:
    """The tier and the engines (started after this, inheriting the environment) poison
    every buffer given back (NaN bytes), so a read of one after it was given back changes
    the outputs or fails a checksum every time, not now and then (kvtier.proto.buffers)."""
    before = os.environ.get(POISON_ENV)
    os.environ[POISON_ENV] = "1"
    yield
    if before is None:
        del os.environ[POISON_ENV]
    else:
        os.environ[POISON_ENV] = before


@pytest.fixture(scope="module")
def tier(module_dir: Path) -> Iterator[TierProcess]:
    tier = TierProcess.start(
        module_dir / "tier", "--data-port", str(free_port()), "--ram-bytes", "24MiB"
    )
    yield tier
    tier.stop()


@pytest.fixture(scope="module")
def engines(
    text_model: Path, tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> tuple[EngineProcess, EngineProcess]:
    """A (zstd) and B (raw)."""
    config = {"target": tier.target, "chunk_size": CHUNK, **RELAXED}
    a = start_engine(
        text_model, name="a", extra_config={**config, "codec": "zstd"},
        llm_kwargs=ENGINE_ARGS, wait=False,
    )  # fmt: skip
    b = start_engine(
        text_model, name="b", extra_config={**config, "codec": "raw"},
        llm_kwargs=ENGINE_ARGS, wait=False,
    )  # fmt: skip
    a.wait_ready()
    b.wait_ready()
    return a, b


def prompts(round_: int) -> list[dict[str, str]]:
    return [
        {"prompt": prompt_text(PROMPT_WORDS, seed=1000 * round_ + i)}
        for i in range(PROMPTS_PER_ROUND)
    ]


def tokens(outputs: list[Output]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_engines_under_cpu_contention_load_every_chunk_with_the_no_cache_output(
    engines: tuple[EngineProcess, EngineProcess], tier: TierProcess
) -> None:
    a, b = engines
    with busy_cpus(busy_count(per_cpu=2)):
        for round_ in range(ROUNDS):
            saver, loader = (a, b) if round_ % 2 == 0 else (b, a)
            batch = prompts(round_)
            saved = saver.generate(batch)  # the no-cache run
            saver.flush()
            before = loader.stats()
            loaded = loader.generate(batch)
            after = loader.stats()

            assert all(o.num_cached_tokens == 0 for o in saved)
            assert all(o.num_prompt_tokens > FULL_CHUNKS * CHUNK for o in saved)
            assert tokens(loaded) == tokens(saved), f"round {round_}: the loading run"
            assert all(o.num_cached_tokens == FULL_CHUNKS * CHUNK for o in loaded)
            assert after.get("loaded_chunks", 0) - before.get("loaded_chunks", 0) == (
                FULL_CHUNKS * PROMPTS_PER_ROUND
            ), f"round {round_}: every full chunk is loaded, none recomputed"
            assert after.get("load_failed_blocks", 0) == before.get("load_failed_blocks", 0)
            found = loader.kv_nonfinite()["found"]  # no NaN or inf anywhere (tests/recipes/test_contention.py)
            assert found == [], f"round {round_}: NaN or inf in the loader's KV cache, [tensor, block]: {found}"

    # The recycling paths ran: A received B's raw chunks (all one size) into buffers given
    # back by its earlier loads, and the tier received Puts into buffers of values it
    # evicted. (A's zstd chunks differ in size and are under 1 MiB: B allocates for them.)
    assert a.receive_buffers()["reused"] > 0
    assert tier.metric("kvtier_ram_recycled_buffers_reused_total") > 0
    for engine in (a, b):
        assert not [k for k, v in engine.stats().items() if k.startswith("corrupt_chunks") and v]
        assert engine.kv_nonfinite()["found"] == []


FAILING_ROUNDS = 2


def test_engines_under_cpu_contention_with_failing_loads_store_only_recomputed_chunks(
    engines: tuple[EngineProcess, EngineProcess], tier: TierProcess
) -> None:
    """Loads that fail while their step computes more of the prompt on top of them (tests/
    e2e/test_vllm_text.py has the single-engine case): the saver stores 2 chunks of each
    prompt, the second is corrupted in the tier, and the loader runs a prompt extending it
    to 3 chunks (loads chunk 0, chunk 1 fails, chunk 2 is computed in the same step on top
    of the unfilled blocks). The saver then runs its own prompt again (storing chunk 1
    again, had it been missing) and the extended one, loading all 3 chunks: every output is
    the no-cache run's."""
    from kvtier.connector.client import TierClient

    a, b = engines
    with busy_cpus(busy_count(per_cpu=2)), TierClient(tier.target) as client:
        for round_ in range(FAILING_ROUNDS):
            saver, loader = (a, b) if round_ % 2 == 0 else (b, a)
            seeds = [5000 + 10 * round_ + i for i in range(PROMPTS_PER_ROUND)]
            short = [prompt_text(1500, seed=s) for s in seeds]
            long = [
                p + " " + prompt_text(800, seed=s + 1) for p, s in zip(short, seeds, strict=True)
            ]
            keys = [loader.chunk_keys(p) for p in long]
            assert all(len(k) == FULL_CHUNKS for k in keys)
            saver.generate([{"prompt": p} for p in short])
            saver.flush()
            for k in keys:
                assert client.lookup(k) == 2
                blob = bytearray(client.get(k[1:2])[0])
                blob[-100] ^= 0xFF
                assert client.put([(k[1], bytes(blob))]) == 1

            before = loader.stats()
            recomputed = loader.generate([{"prompt": p} for p in long])
            loader.flush()
            after = loader.stats()
            reference = loader.generate(
                [{"prompt": p, "cache_salt": f"reference-{round_}"} for p in long]
            )
            saver.generate([{"prompt": p} for p in short])
            saver.flush()
            before_saver = saver.stats()
            loaded = saver.generate([{"prompt": p} for p in long])
            after_saver = saver.stats()

            assert tokens(recomputed) == tokens(reference), f"round {round_}: the failing loads"
            assert tokens(loaded) == tokens(reference), f"round {round_}: loading every chunk"
            assert after.get("corrupt_chunks:checksum", 0) - before.get(
                "corrupt_chunks:checksum", 0
            ) == len(long)
            # vLLM's token budget (4,096 on the CPU) puts one or two of the requests in the
            # step of each failed load: that step stored none of the chunks it completed.
            assert after.get("saves_dropped:load_failed", 0) > before.get(
                "saves_dropped:load_failed", 0
            ), f"round {round_}: the chunks computed on a failed load"
            assert after_saver.get("loaded_chunks", 0) - before_saver.get(
                "loaded_chunks", 0
            ) == FULL_CHUNKS * len(long)
