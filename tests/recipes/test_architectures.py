"""Every recipe architecture, end to end: a tiny random-weight model of the exact vLLM
class, two real vLLM engine processes with the kvtier connector, one real tier.

For each architecture the same item (image or audio clip) with the same text hits in the
other process with output identical to the no-cache run, and another item with the same
text reuses only the chunks before the item. The item sits in chunk 1, so "only the
chunks before it" is exactly one chunk. A unique ``cache_salt`` gives the no-cache
reference.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.recipes.conftest import CHUNK, Engines
from tests.tinymodels import prompt_text

pytestmark = pytest.mark.vllm

MARGIN = 8  # tokens the item keeps from a chunk boundary, whatever the tokenizer does


def prompt_with_item_in_chunk_1(engines: Engines) -> str:
    """Text, one item, text: the item's placeholder span lies inside chunk 1, and the
    prompt has three full chunks."""
    arch, b = engines.arch, engines.b
    for words in range(80, 240, 5):
        before = arch.prompt(prompt_text(words, seed=30))[: -len(arch.turn[1])]
        start = len(b.tokenize(before))
        if start >= CHUNK + MARGIN and start + arch.item_tokens + MARGIN <= 2 * CHUNK:
            return arch.prompt(
                prompt_text(words, seed=30), arch.item_marker, prompt_text(250, seed=31)
            )
    raise AssertionError(f"no prefix length puts a {arch.page} item inside chunk 1")


def request(engines: Engines, prompt: str, seed: int, salt: str | None = None) -> dict[str, Any]:
    key = "audios" if engines.arch.modality == "audio" else "images"
    message: dict[str, Any] = {"prompt": prompt, key: [engines.arch.item(seed)]}
    if salt is not None:
        message["cache_salt"] = salt
    return message


def test_same_item_hits_in_another_process_with_identical_output(engines: Engines) -> None:
    prompt = prompt_with_item_in_chunk_1(engines)
    (saved,) = engines.a.generate([request(engines, prompt, seed=1)])
    assert saved.num_cached_tokens == 0  # nothing stored yet: A's run is a no-cache run
    engines.a.flush()

    (loaded,) = engines.b.generate([request(engines, prompt, seed=1)])

    assert loaded.num_prompt_tokens > 3 * CHUNK
    assert loaded.num_cached_tokens == loaded.num_prompt_tokens // CHUNK * CHUNK
    assert loaded.token_ids == saved.token_ids
    assert len(set(saved.token_ids)) > 1, "degenerate output would hide a wrong KV load"


def test_other_item_with_same_text_reuses_only_chunks_before_it(engines: Engines) -> None:
    prompt = prompt_with_item_in_chunk_1(engines)
    engines.a.generate([request(engines, prompt, seed=2)])
    engines.a.flush()

    (other,) = engines.b.generate([request(engines, prompt, seed=3)])
    (reference,) = engines.b.generate([request(engines, prompt, seed=3, salt="reference")])

    assert other.num_cached_tokens == CHUNK  # chunk 0 only: chunk 1 holds the item
    assert reference.num_cached_tokens == 0
    assert other.token_ids == reference.token_ids


HYBRID_OFF = "Hybrid KV cache manager is disabled for this hybrid model"


def test_hybrid_kv_cache_manager_is_off_exactly_for_sliding_window_models(
    engines: Engines,
) -> None:
    """With kvtier configured, vLLM 0.32 turns its hybrid KV cache manager off (the
    connector does not subclass SupportsHMA): a sliding-window model keeps a block for
    every token of every layer, in one KV cache group, and says so in its log."""
    for engine in (engines.a, engines.b):
        log = engine.log.read_text(errors="replace")
        assert "Turning off hybrid kv cache manager" in log
        assert (HYBRID_OFF in log) == engines.arch.sliding_window
