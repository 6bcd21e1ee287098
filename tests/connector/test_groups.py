"""KV cache groups: what each stores of a chunk and what a hit loads, against vLLM's own rule.

vLLM's sliding-window manager skips ``max(0, n - window + 1)`` tokens once ``n`` are
computed (``SlidingWindowManager.get_num_skipped_tokens``), its chunked-local manager
``n // chunk * chunk``; those are checked here against vLLM's code itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvtier.connector.kv.groups import CHUNKED_LOCAL, FULL, SLIDING_WINDOW, KVGroup

BLOCK, CHUNK = 128, 256


def sliding(window: int, extra: int = 0, block: int = BLOCK) -> KVGroup:
    return KVGroup(block, SLIDING_WINDOW, window, extra, tag="0/2 sliding")


def test_a_full_attention_group_stores_and_loads_every_block() -> None:
    full = KVGroup(BLOCK)
    assert [full.stored_from(c, CHUNK) for c in range(4)] == [0, 0, 0, 0]
    assert full.needed(256, 1024) == range(2, 8)
    assert full.covers(896, CHUNK)


def test_a_window_as_long_as_a_chunk_stores_every_block_and_loads_the_last_window() -> None:
    group = sliding(512)
    assert [group.stored_from(c, CHUNK) for c in range(6)] == [0] * 6
    # A hit of 1280 tokens keeps tokens 769.. (blocks 6..9); blocks 0..5 are vLLM's nulls.
    assert group.needed(0, 1280) == range(6, 10)
    # vLLM holds the first 1024 itself (a local prefix-cache hit past the window).
    assert group.needed(1024, 1280) == range(8, 10)


def test_a_window_shorter_than_a_chunk_stores_only_the_chunk_tail() -> None:
    group = sliding(128)  # keeps tokens end-127..: the chunk's last block
    assert [group.stored_from(c, CHUNK) for c in range(3)] == [1, 1, 1]
    assert group.needed(0, 768) == range(5, 6)


def test_a_hit_ending_inside_a_chunk_is_covered_only_if_that_chunk_stores_its_window() -> None:
    # 128-token window, chunk 256: a hit ending at 640 needs block 4 (tokens 513..639),
    # the first block of chunk 2, which stores only its last block (what a hit at 768 needs).
    assert not sliding(128).covers(640, CHUNK)
    # A 512-token window stores whole chunks: every end is covered.
    assert sliding(512).covers(640, CHUNK)
    # Chunk ends are always covered.
    assert all(sliding(128).covers(end, CHUNK) for end in (256, 512, 768))


def test_extra_retained_tokens_widen_what_is_kept() -> None:
    assert sliding(128, extra=128).stored_from(2, CHUNK) == 0
    assert sliding(128, extra=128).needed(0, 768) == range(4, 6)


def test_a_chunked_local_group_keeps_the_current_attention_chunk() -> None:
    group = KVGroup(BLOCK, CHUNKED_LOCAL, 512, tag="1/2 chunked_local=512")
    assert group.first_kept(1280) == 1024
    assert group.needed(0, 1280) == range(8, 10)
    assert group.needed(0, 1024) == range(8, 8)  # a hit on the boundary needs none
    assert [group.stored_from(c, CHUNK) for c in range(4)] == [0, 2, 0, 2]


VLLM_FACTS = """
import json, sys
import torch
from vllm.v1.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager, SlidingWindowManager)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec)
from kvtier.connector.errors import ConfigError
from kvtier.connector.kv.vllmspec import retention as _retention
skipped = {}
for window in (128, 256, 384, 512, 1024):
    m = SlidingWindowManager.__new__(SlidingWindowManager)
    m.sliding_window, m.extra_retained_tokens = window, 0
    skipped[f"sliding_window={window}"] = [m.get_num_skipped_tokens(n) for n in range(0, 4096, 64)]
m = ChunkedLocalAttentionManager.__new__(ChunkedLocalAttentionManager)
m.attention_chunk_size = 512
skipped["chunked_local=512"] = [m.get_num_skipped_tokens(n) for n in range(0, 4096, 64)]
attention = dict(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
kinds = [
    _retention(SlidingWindowSpec(**attention, sliding_window=1024), 0, 2),
    _retention(ChunkedLocalAttentionSpec(**attention, attention_chunk_size=8192), 0, 2),
    # With the manager off vLLM gives a hybrid model's sliding-window layers this spec.
    _retention(FullAttentionSpec(**attention, sliding_window=1024), 1, 2),
]
try:
    _retention(MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,)), 1, 2)
    refused = ""
except ConfigError as exc:
    refused = str(exc)
sys.stdout.write(json.dumps({"skipped": skipped, "kinds": kinds, "refused": refused}))
"""


@pytest.fixture(scope="module")
def vllm_facts() -> dict[str, Any]:
    """vLLM's own skipped-token counts (its managers' code) and the kinds kvtier gives
    vLLM's KV cache specs, computed in a separate process (importing vLLM is slow)."""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", VLLM_FACTS],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.mark.vllm
def test_groups_keep_what_vllm_keeps(vllm_facts: dict[str, Any]) -> None:
    for name, skipped in vllm_facts["skipped"].items():
        kind, _, window = name.partition("=")
        group = KVGroup(BLOCK, kind, int(window), tag=name)
        assert [group.first_kept(n) for n in range(0, 4096, 64)] == skipped, name


@pytest.mark.vllm
def test_vllms_group_specs_map_to_kinds_and_a_mamba_group_is_refused_naming_it(
    vllm_facts: dict[str, Any],
) -> None:
    assert vllm_facts["kinds"] == [
        [SLIDING_WINDOW, 1024, 0],
        [CHUNKED_LOCAL, 8192, 0],
        [FULL, 0, 0],
    ]
    assert "KV cache group 1 of 2 is MambaSpec" in vllm_facts["refused"]


def test_each_chunk_stores_what_every_chunk_aligned_hit_needs_from_it() -> None:
    for group in (sliding(128), sliding(256), sliding(384), sliding(640), KVGroup(BLOCK)):
        per_chunk = CHUNK // group.block_size
        for hit in range(1, 12):
            for block in group.needed(0, hit * CHUNK):
                chunk = block // per_chunk
                assert block - chunk * per_chunk >= group.stored_from(chunk, CHUNK)


def test_tags_name_every_group_but_a_lone_full_attention_group() -> None:
    assert KVGroup.describe(0, 1, FULL, 0, 0) == ""
    assert KVGroup.describe(1, 2, FULL, 0, 0) == "1/2 full"
    assert KVGroup.describe(0, 2, SLIDING_WINDOW, 1024, 0) == "0/2 sliding_window=1024"
    assert KVGroup.describe(0, 1, SLIDING_WINDOW, 4096, 0) == "0/1 sliding_window=4096"
    assert KVGroup.describe(0, 2, SLIDING_WINDOW, 1024, 3) == "0/2 sliding_window=1024+3"


def test_a_group_kind_must_be_known_and_a_window_given() -> None:
    with pytest.raises(ValueError, match="kind"):
        KVGroup(BLOCK, "mamba")
    with pytest.raises(ValueError, match="window"):
        KVGroup(BLOCK, SLIDING_WINDOW)

