"""Hybrid-attention models with vLLM's hybrid KV cache manager on, end to end.

For each hybrid architecture (Gemma 3: five sliding-window layers per full-attention
layer; Cohere2 Vision: three per one) a tiny random-weight model with a 512-token window
(so prompts longer than the window are cheap on the CPU), a real tier and three real
vLLM engine processes with the kvtier connector: A and B with the hybrid manager on (vLLM
decides: kvtier supports it), B with vLLM's own prefix cache on, C with the manager off
(``disable_hybrid_kv_cache_manager``). With the manager on every layer is its own KV
cache group (vLLM groups layers per kind of attention, one layer per group here), and
kvtier stores and loads each group apart: all blocks of the full-attention group, only
the blocks the hit keeps of a sliding-window group (``kvtier.connector.kv.groups``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.engine import EngineProcess, Output
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import (
    build_cohere2_vision_model,
    build_gemma3_model,
    prompt_text,
)
from tests.e2e.conftest import RELAXED
from tests.recipes.architectures import BY_PAGE, Architecture
from tests.recipes.conftest import wait_for_model_inspection

pytestmark = pytest.mark.vllm

CHUNK, BLOCK, WINDOW = 256, 128, 512
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Hybrid:
    arch: Architecture
    build: Callable[[Path], Path]
    layers: tuple[str, ...]


HYBRIDS = [
    Hybrid(
        BY_PAGE["gemma3"],
        lambda out: build_gemma3_model(
            out, sliding_window=WINDOW, layer_types=(SLIDING,) * 5 + (FULL,)
        ),
        (SLIDING,) * 5 + (FULL,),
    ),
    Hybrid(
        BY_PAGE["cohere2_vision"],
        # vLLM's window for Cohere2 is the config's + 1.
        lambda out: build_cohere2_vision_model(
            out, sliding_window=WINDOW - 1, layer_types=(SLIDING,) * 3 + (FULL,)
        ),
        (SLIDING,) * 3 + (FULL,),
    ),
]


@dataclass
class Engines:
    hybrid: Hybrid
    a: EngineProcess
    b: EngineProcess
    off: EngineProcess

    @property
    def arch(self) -> Architecture:
        return self.hybrid.arch

    @property
    def sliding_groups(self) -> int:
        return self.hybrid.layers.count(SLIDING)


@pytest.fixture(scope="module", params=HYBRIDS, ids=lambda h: h.arch.page)
def engines(
    request: pytest.FixtureRequest, recipes_dir: Path, recipes_tier: TierProcess
) -> Iterator[Engines]:
    hybrid: Hybrid = request.param
    model = hybrid.build(recipes_dir / "models" / f"{hybrid.arch.page}-window{WINDOW}")
    config = {"target": recipes_tier.target, "chunk_size": CHUNK, **RELAXED}
    work = recipes_dir / "hybrid"
    options: dict[str, dict[str, Any]] = {
        "a": {},
        "b": {"enable_prefix_caching": True},
        "off": {"disable_hybrid_kv_cache_manager": True},
    }
    started: list[EngineProcess] = []
    try:
        for name, llm_kwargs in options.items():
            if started:
                wait_for_model_inspection(work / "vllm-cache", hybrid.arch, started[0])
            started.append(
                EngineProcess.start(
                    model,
                    work / f"{hybrid.arch.page}-{name}",
                    name=name,
                    extra_config=config,
                    multimodal=True,
                    limit_mm_per_prompt=hybrid.arch.mm_limits,
                    llm_kwargs=llm_kwargs,
                    wait=False,
                )
            )
        for engine in started:
            engine.wait_ready()
        yield Engines(hybrid, *started)
    finally:
        for engine in started:
            engine.begin_close()
        for engine in started:
            engine.close()


def long_request(engines: Engines, seed: int) -> dict[str, Any]:
    """Text, an image, text: about 2,400 tokens, between four and five windows long."""
    arch = engines.arch
    prompt = arch.prompt(
        prompt_text(80, seed=seed), arch.item_marker, prompt_text(1100, seed=seed + 1)
    )
    return {"prompt": prompt, "images": [arch.item(seed)]}


def hit_end(prompt_tokens: int) -> int:
    """The longest hit vLLM takes: whole chunks, never the last token's block."""
    return min(prompt_tokens // CHUNK * CHUNK, (prompt_tokens - 1) // BLOCK * BLOCK)


def window_chunks(end: int, start: int = 0) -> int:
    """Chunks a sliding-window group loads for a hit of ``end`` tokens when the engine
    holds the first ``start``: those holding tokens ``end - WINDOW + 1`` (vLLM keeps
    nothing before) or ``start`` to ``end``."""
    first_block = max(start, end - WINDOW + 1) // BLOCK
    return -(-end // CHUNK) - first_block * BLOCK // CHUNK


def loaded(engine: EngineProcess, run: Callable[[], Output]) -> tuple[Output, dict[str, float]]:
    """``run()``'s output, and what the connector counted meanwhile."""
    before = engine.stats()
    output = run()
    after = engine.stats()
    return output, {k: after.get(k, 0) - before.get(k, 0) for k in after}


def test_the_manager_is_on_with_a_kv_cache_group_per_layer_kind_and_off_when_asked(
    engines: Engines,
) -> None:
    for engine in (engines.a, engines.b):
        groups = engine.kv_cache_groups()
        assert groups["hybrid_manager"] is True
        assert [g["spec"] for g in groups["groups"]] == [
            "SlidingWindowSpec" if kind == SLIDING else "FullAttentionSpec"
            for kind in engines.hybrid.layers
        ]
        assert {g["sliding_window"] for g in groups["groups"][:-1]} == {WINDOW}
        assert "Turning off hybrid kv cache manager" not in engine.log.read_text(errors="replace")
    off = engines.off.kv_cache_groups()
    assert off["hybrid_manager"] is False
    assert [g["layers"] for g in off["groups"]] == [len(engines.hybrid.layers)]


def test_a_prompt_longer_than_the_window_hits_in_another_process_loading_only_the_window(
    engines: Engines,
) -> None:
    message = long_request(engines, seed=60)
    (saved,) = engines.a.generate([message])
    assert saved.num_cached_tokens == 0  # a no-cache run
    engines.a.flush()

    hit, counted = loaded(engines.b, lambda: engines.b.generate([message])[0])

    end = hit_end(saved.num_prompt_tokens)
    assert end > 4 * WINDOW  # the hit's window starts far past the prompt's start
    assert hit.num_cached_tokens == end
    assert hit.token_ids == saved.token_ids
    assert len(set(saved.token_ids)) > 1, "degenerate output would hide a wrong KV load"
    # Every chunk of the full-attention group, two per sliding-window group.
    full_chunks = end // CHUNK
    assert counted["loaded_chunks"] == full_chunks + engines.sliding_groups * window_chunks(end)
    page = engines.a.kv_cache_groups()["groups"][0]["page_bytes"]
    payload = (full_chunks + engines.sliding_groups * window_chunks(end)) * (CHUNK // BLOCK) * page
    assert payload <= counted["loaded_bytes"] <= payload + 256 * counted["loaded_chunks"]
    # With the manager off the same hit loads every block of every layer.
    assert payload < full_chunks * len(engines.hybrid.layers) * (CHUNK // BLOCK) * page / 2


def test_a_repeated_prompt_hits_the_tier_with_identical_output(engines: Engines) -> None:
    message = long_request(engines, seed=64)
    (first,) = engines.a.generate([message])
    engines.a.flush()
    (again,) = engines.a.generate([message])
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == hit_end(first.num_prompt_tokens)
    assert again.token_ids == first.token_ids


def test_a_hit_past_a_local_prefix_hit_longer_than_the_window_loads_only_the_rest(
    engines: Engines,
) -> None:
    """B holds the first 1,024 tokens in vLLM's own prefix cache (two windows); the tier
    holds the whole prompt: B loads only the chunks after its local hit, and of the
    sliding-window groups only the window's blocks past it.

    The reference is A's run with a tier hit of the same length: the tokens after a hit
    are computed in a prefill of their own, which vLLM's CPU kernels may round apart from
    one whole prefill (vLLM's own prefix cache, without kvtier, gives this prompt the
    same output as both hits, and the whole prefill another one at the 10th token)."""
    a, b = engines.a, engines.b
    ids = a.tokenize(engines.arch.prompt(prompt_text(800, seed=70)))
    assert len(ids) > 1600
    end = hit_end(len(ids))
    a.generate([{"prompt_token_ids": ids}])
    a.flush()
    (reference,) = a.generate([{"prompt_token_ids": ids}])
    assert reference.num_cached_tokens == end
    b.generate([{"prompt_token_ids": ids[:1100]}])  # B's prefix cache: 1,024 tokens

    hit, counted = loaded(b, lambda: b.generate([{"prompt_token_ids": ids}])[0])

    assert hit.num_cached_tokens == end
    assert counted["hit_tokens"] == end - 1024  # the tier's part
    assert hit.token_ids == reference.token_ids
    # Chunks 4.. of the full group; the window's blocks past token 1,024 of the others.
    sliding = engines.sliding_groups * window_chunks(end, start=1024)
    assert counted["loaded_chunks"] == (end - 1024) // CHUNK + sliding


def test_chunks_of_the_manager_on_and_off_never_meet_and_outputs_agree(engines: Engines) -> None:
    on, off = engines.a, engines.off
    message = long_request(engines, seed=80)
    (from_off,) = off.generate([message])
    off.flush()
    (from_on,) = on.generate([message])
    assert from_off.num_cached_tokens == 0 and from_on.num_cached_tokens == 0
    assert from_on.token_ids == from_off.token_ids  # same model, either manager
    on.flush()

    other = long_request(engines, seed=84)
    (first_on,) = on.generate([other])
    on.flush()
    (then_off,) = off.generate([other])
    (off_again,) = off.generate([message])  # its own chunks do hit
    assert first_on.num_cached_tokens == 0 and then_off.num_cached_tokens == 0
    assert off_again.num_cached_tokens == hit_end(off_again.num_prompt_tokens)
    assert then_off.token_ids == first_on.token_ids


def test_kv_memory_per_request_with_the_manager_on_and_off(engines: Engines) -> None:
    """The blocks vLLM's KV cache manager holds for a ~3,000-token prompt at its last
    step: with the manager on each sliding-window group keeps its window, with it off
    every layer keeps a block per 128 tokens."""
    message = {"prompt": engines.arch.prompt(prompt_text(1500, seed=90))}
    on, off = engines.a.kv_blocks(message), engines.off.kv_blocks(message)
    tokens = len(engines.a.tokenize(message["prompt"]))
    prompt_blocks = -(-tokens // BLOCK)

    window_blocks = -(-(WINDOW - 1) // BLOCK) + 1  # vLLM's bound: the window may straddle
    *sliding, full = on["last"]
    assert prompt_blocks <= full <= prompt_blocks + 1  # +1: a decoded token's block
    assert all(0 < held <= window_blocks for held in sliding)
    assert len(sliding) == engines.sliding_groups
    assert off["last"] == [full]
    on_bytes = sum(b * size for b, size in zip(on["last"], on["block_bytes"], strict=True))
    off_bytes = off["last"][0] * off["block_bytes"][0]
    layers = len(engines.hybrid.layers)
    assert off_bytes == full * layers * on["block_bytes"][-1]
    assert on_bytes <= (full + engines.sliding_groups * window_blocks) * on["block_bytes"][-1]
    assert on_bytes < off_bytes / 2
