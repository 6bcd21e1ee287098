"""What the encoder cache's scheduler half tells its workers each engine step: an ``ECStepPlan``.

Plain values (pickled between processes, inside vLLM's ``KvtierECConnectorMetadata``).
This module imports neither vLLM nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EncoderLoad:
    """A verified encoder output on its way to the worker's encoder cache."""

    identifier: str
    dtype: str
    shape: tuple[int, ...]
    payload: bytes


@dataclass
class ECStepPlan:
    """One step's work for the worker: loads to place, and keys to save new outputs under."""

    loads: list[EncoderLoad] = field(default_factory=list)
    saves: dict[str, bytes] = field(default_factory=dict)
    """identifier -> key, for the items vLLM encodes this step."""
