"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.tierproc import TierProcess


@pytest.fixture
def start_tier(tmp_path: Path) -> Iterator[Callable[..., TierProcess]]:
    """Starts real ``kvtier server`` processes (``start_tier(*flags, **TierProcess.start options)``);
    stops them all after the test."""
    started: list[TierProcess] = []

    def start(*flags: str, name: str = "tier", **options: Any) -> TierProcess:
        tier = TierProcess.start(tmp_path / f"{name}{len(started)}", *flags, **options)
        started.append(tier)
        return tier

    yield start
    for tier in started:
        tier.stop()


@pytest.fixture
def tier(start_tier: Callable[..., TierProcess]) -> TierProcess:
    """A running tier with the default tiers (RAM + disk under the test's tmp dir)."""
    return start_tier()
