"""Gemma 3 (vLLM's hybrid KV cache manager on) loading and saving under deliberate CPU
contention (issue 21, defect 1).

The wrong output that defect names came from this architecture, in a full test run on a
loaded machine: engine B loaded every full chunk of a prompt engine A had saved, then
generated ``[193, 0, 0, ...]`` where A's no-cache run generated ``[193, 193, ...]``.
tests/e2e/test_vllm_contention.py runs a one-group text model under contention; this
runs the path Gemma 3 takes: several KV cache groups (sliding-window and full
attention), loads vLLM waits for (reported through ``finished_loads``), an image per
prompt whose encoder output is shared through the tier too.

A NaN anywhere in an engine's KV cache is enough for that output: vLLM's CPU attention
reads the unwritten slots of a request's blocks (``python -m kvtier.bench.nanslots``), so
NaN bytes left in a block turn the output of whichever request decodes into it next to
token 0s, now or many requests later. So after every round the loading engine's whole KV
cache (and at the end both engines') is scanned for NaN and infinities
(``EngineProcess.kv_nonfinite``): a bad write fails the round it happened in, read or not.

Busy processes, two per CPU, compete with the engines and the tier for every round; a
round sends a batch of prompts (several loads and saves in the same steps) from one
engine to the other (A stores zstd chunks, B raw), the next round the other way. The
saving engine's run is a no-cache run (nothing of the batch is in the tier yet), the
reference for the loading run: every output identical, every full chunk loaded by the
worker (its ``loaded_chunks``, not vLLM's ``num_cached_tokens``, which the scheduler's
Lookup sets even when a load then fails), no load failed, nothing corrupt.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.proto.buffers import POISON_ENV
from kvtier.testing.contention import busy_count, busy_cpus
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import prompt_text
from tests.recipes.architectures import BY_PAGE
from tests.recipes.conftest import CHUNK, Engines, two_engines

pytestmark = pytest.mark.vllm

ROUNDS = 6
PROMPTS_PER_ROUND = 3
TEXT_WORDS = 500  # with the image (256 tokens), about 980 tokens: three full chunks and a partial
FULL_CHUNKS = 3


@pytest.fixture(scope="module")
def gemma3(recipes_dir: Path, recipes_tier: TierProcess) -> Iterator[Engines]:
    # Buffers given back are poisoned (NaN bytes): a read of one after it was given back
    # changes the outputs every time, not now and then (kvtier.proto.buffers).
    poison = {POISON_ENV: "1"}
    with two_engines(
        BY_PAGE["gemma3"], recipes_dir, recipes_tier, tag="-contention", env=poison
    ) as e:
        yield e


def batch(engines: Engines, round_: int) -> list[dict[str, Any]]:
    """Prompts with an image in the middle of their text, new in each round."""
    arch = engines.arch
    out = []
    for i in range(PROMPTS_PER_ROUND):
        seed = 7000 + 100 * round_ + i
        prompt = arch.prompt(
            prompt_text(TEXT_WORDS // 2, seed=seed), arch.item_marker,
            prompt_text(TEXT_WORDS // 2, seed=seed + 50),
        )  # fmt: skip
        out.append({"prompt": prompt, "images": [arch.item(seed)]})
    return out


def counted(stats: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in stats.items() if k.startswith(prefix))


def test_gemma3_engines_under_cpu_contention_load_every_chunk_with_the_no_cache_output(
    gemma3: Engines,
) -> None:
    a, b = gemma3.a, gemma3.b
    groups = b.kv_cache_groups()["groups"]
    assert len(groups) > 1, f"the hybrid manager is off: {groups}"
    with busy_cpus(busy_count(per_cpu=2)):
        for round_ in range(ROUNDS):
            saver, loader = (a, b) if round_ % 2 == 0 else (b, a)
            prompts = batch(gemma3, round_)
            saved = saver.generate(prompts)  # the no-cache run
            saver.flush()
            before = loader.stats()
            loaded = loader.generate(prompts)
            after = loader.stats()

            assert all(o.num_cached_tokens == 0 for o in saved)
            lengths = [o.num_prompt_tokens for o in saved]
            assert all(n > FULL_CHUNKS * CHUNK for n in lengths), lengths
            assert all(len(set(o.token_ids)) > 1 for o in saved), "degenerate reference"
            assert [o.token_ids for o in loaded] == [o.token_ids for o in saved], (
                f"round {round_}: the loading run differs from the no-cache run"
            )
            hits = [o.num_cached_tokens // CHUNK for o in loaded]
            assert hits == [(o.num_prompt_tokens - 1) // CHUNK for o in saved]
            assert after.get("loaded_chunks", 0) - before.get("loaded_chunks", 0) >= sum(hits), (
                f"round {round_}: a full chunk was recomputed, not loaded"
            )
            assert counted(after, "load_failed_blocks") == counted(before, "load_failed_blocks")
            found = loader.kv_nonfinite()["found"]  # nothing non-finite, read or not (yet)
            assert found == [], f"round {round_}: NaN or inf in the loader's KV cache, [tensor, block]: {found}"
    for engine in (a, b):
        assert counted(engine.stats(), "corrupt_chunks") == 0
        assert engine.kv_nonfinite()["found"] == []
