"""What the scheduler half tells the worker half each engine step: a ``StepPlan``.

Plain lists of ints and bytes (pickled between processes, inside vLLM's
``KvtierConnectorMetadata``). Keys come per tensor-parallel rank (``keys[rank]``),
because each rank stores its own heads. ``group`` is the index of the engine's KV
cache group (``kvtier.connector.kv.groups``); a group that does not store a whole chunk
stores its blocks from ``stored_from`` (counted within the chunk) on. This module does
not import vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChunkLoad:
    """Fill ``block_ids`` from blocks ``first_block:first_block+len(block_ids)`` of a stored
    chunk (counted in what it stores)."""

    keys: tuple[bytes, ...]
    first_block: int
    block_ids: tuple[int, ...]
    group: int = 0
    stored_from: int = 0


@dataclass(frozen=True)
class RequestLoad:
    """One request's load this step: its chunks in prefix order (a failed chunk fails the rest).

    ``report``: the load is one vLLM waits for (an engine with several KV cache groups):
    the worker reports the request finished, or failed, instead of failed blocks."""

    req_id: str
    chunks: tuple[ChunkLoad, ...]
    report: bool = False


@dataclass(frozen=True)
class ChunkSave:
    """Save the chunk held in ``block_ids`` (what its group stores of it) under ``keys[rank]``."""

    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    group: int = 0
    stored_from: int = 0


@dataclass
class StepPlan:
    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    failed_blocks: list[int] = field(default_factory=list)
    """Blocks promised to vLLM that the scheduler could not plan: report them failed."""
    failed_loads: list[str] = field(default_factory=list)
    """Reported loads (``RequestLoad.report``) the scheduler could not plan: report them failed."""
