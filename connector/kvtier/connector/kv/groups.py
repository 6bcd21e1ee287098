"""KV cache groups: which blocks of a chunk each group stores, and which blocks a hit loads.

vLLM's hybrid KV cache manager gives every kind of attention its own KV cache group,
each with its own block table. A full-attention group keeps a block for every token.
A sliding-window group of window ``W`` frees the blocks of tokens the window has passed:
after computing ``end`` tokens it keeps only tokens ``end - W + 1`` on (vLLM's
``SlidingWindowManager.get_num_skipped_tokens``; ``extra_tokens`` more below the window
for multi-token prediction), and a prefix hit of ``end`` tokens gets real blocks only for
those, null blocks before them. A chunked-local-attention group (Llama 4) keeps the
tokens of the current attention chunk, from ``end // C * C`` on.

kvtier stores, per prompt chunk and per group, one object (its own key): the chunk's
blocks of every layer of that group. A full-attention group stores all of the chunk's
blocks. Another group stores the blocks a hit ending at the chunk's end needs: those
from ``first_kept(chunk end)`` on (all of the chunk when the window is at least a
chunk). A hit of ``end`` tokens loads, per group, the blocks ``first_kept(end)`` to
``end`` that vLLM did not find locally, and nothing before them: exactly what vLLM would
have kept. ``first_kept`` never decreases with ``end``, so an earlier chunk always
stores what a later hit needs from it; only a hit ending inside a chunk (the engine's
last block is always computed) may need blocks its chunk did not store, and
``covers`` says so.

An engine with one full-attention group (every non-hybrid model, and hybrid models
with the manager off) is what kvtier stored before groups existed: its ``tag`` is
``""``, and its keys and chunk headers are unchanged. Every other group has a tag
(``"1/6 sliding_window=1024"``) written into its keys' layout and into its chunks'
headers, so no chunk is ever loaded into another group or into an engine with the
manager in the other state. This module imports neither vLLM nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvtier.connector.chunks.keys import KeySpec

__all__ = ["CHUNKED_LOCAL", "FULL", "KINDS", "NULL_BLOCK", "SLIDING_WINDOW", "KVGroup"]

FULL: Final = "full"
SLIDING_WINDOW: Final = "sliding_window"
CHUNKED_LOCAL: Final = "chunked_local"
KINDS: Final = (FULL, SLIDING_WINDOW, CHUNKED_LOCAL)

NULL_BLOCK: Final = 0
"""vLLM's null block (``BlockPool.null_block``, always block 0): what a group's block
table holds where the group keeps no block. Never loaded into, never saved from."""


@dataclass(frozen=True)
class KVGroup:
    """One of the engine's KV cache groups, as kvtier stores it."""

    block_size: int
    kind: str = FULL
    window: int = 0
    """Tokens: the sliding window, or the attention chunk of chunked local attention."""
    extra_tokens: int = 0
    """Sliding window: tokens vLLM also keeps below the window."""
    tag: str = ""
    """``""`` for an engine's only full-attention group; else names the group (module doc)."""
    specs: tuple[KeySpec, ...] = ()
    """The group's key spec for each tensor-parallel rank."""
    layer_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KVGroup.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != FULL and self.window < 1:
            raise ValueError(f"a {self.kind} group needs a window >= 1, got {self.window!r}")

    @classmethod
    def describe(cls, index: int, count: int, kind: str, window: int, extra_tokens: int) -> str:
        """The tag of group ``index`` of ``count``: ``""`` for a lone full-attention group."""
        if count == 1 and kind == FULL:
            return ""
        name = kind if kind == FULL else f"{kind}={window}"
        return f"{index}/{count} {name}" + (f"+{extra_tokens}" if extra_tokens else "")

    def first_kept(self, end: int) -> int:
        """The first token vLLM keeps for attention once ``end`` tokens are computed."""
        if self.kind == SLIDING_WINDOW:
            return max(0, end - self.window + 1 - self.extra_tokens)
        if self.kind == CHUNKED_LOCAL:
            return end // self.window * self.window
        return 0

    def stored_from(self, chunk: int, chunk_size: int) -> int:
        """The first block of chunk ``chunk`` (counted within the chunk) that it stores."""
        per_chunk = chunk_size // self.block_size
        first = self.first_kept((chunk + 1) * chunk_size) // self.block_size
        return min(per_chunk, max(0, first - chunk * per_chunk))

    def needed(self, start: int, end: int) -> range:
        """The blocks (of the request) a hit of ``end`` tokens loads when the engine
        holds the first ``start`` itself."""
        return range(max(start, self.first_kept(end)) // self.block_size, end // self.block_size)

    def covers(self, end: int, chunk_size: int) -> bool:
        """Whether the chunks before ``end`` store every block a hit of ``end`` needs.

        Chunks that end at or before ``end`` do (``first_kept`` never decreases); only
        the chunk ``end`` falls inside may lack the blocks from ``first_kept(end)`` on."""
        if end % chunk_size == 0:
            return True
        per_chunk = chunk_size // self.block_size
        chunk = end // chunk_size
        first = max(self.first_kept(end) // self.block_size, chunk * per_chunk)
        if first >= end // self.block_size:
            return True
        return first - chunk * per_chunk >= self.stored_from(chunk, chunk_size)
