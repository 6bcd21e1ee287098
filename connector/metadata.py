"""What the scheduler half tells the worker half each engine step: a ``StepPlan``.

Plain lists of ints and bytes (pickled between processes, inside vLLM's
``KvtierConnectorMetadata``). Keys come per tensor-parallel rank (``keys[rank]``),
because each rank stores its own heads. This module does not import vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChunkLoad:
    """Fill ``block_ids`` from blocks ``first_block:first_block+len(block_ids)`` of a chunk."""

    keys: tuple[bytes, ...]
    first_block: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class RequestLoad:
    """One request's load this step: its chunks in prefix order (a failed chunk fails the rest)."""

    req_id: str
    chunks: tuple[ChunkLoad, ...]


@dataclass(frozen=True)
class ChunkSave:
    """Save the chunk held in ``block_ids`` (all its blocks) under ``keys[rank]``."""

    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass
class StepPlan:
    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    failed_blocks: list[int] = field(default_factory=list)
    """Blocks promised to vLLM that the scheduler could not plan: report them failed."""
