"""The disk tier on a real directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvtier.cacheserver import record
from kvtier.cacheserver.disk import DiskTier
from kvtier.cacheserver.errors import TierFailure


async def opened(directory: Path, capacity: int = 10 << 20) -> DiskTier:
    tier = DiskTier(directory, capacity)
    await tier.open()
    return tier


def files(directory: Path) -> list[Path]:
    return sorted(p for p in (directory / "v1").rglob("*") if p.is_file())


async def test_a_value_written_is_read_back_and_survives_reopening(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    assert await tier.put(b"k", b"value" * 1000)
    again = await opened(tmp_path)
    assert again.usage().entries == 1
    got = await again.get(b"k")
    assert got is not None and bytes(got) == b"value" * 1000


async def test_eviction_keeps_the_tier_within_its_capacity(tmp_path: Path) -> None:
    tier = await opened(tmp_path, capacity=300_000)
    for i in range(10):
        assert await tier.put(b"k%d" % i, os.urandom(50_000))
    assert tier.usage().used_bytes <= 300_000
    assert tier.counters.evictions >= 4
    assert sum(p.stat().st_size for p in files(tmp_path)) == tier.usage().used_bytes
    assert await tier.get(b"k0") is None and await tier.get(b"k9") is not None


async def test_a_value_larger_than_the_capacity_is_refused(tmp_path: Path) -> None:
    tier = await opened(tmp_path, capacity=1000)
    assert not await tier.put(b"big", b"x" * 2000)
    assert files(tmp_path) == []


async def test_swapped_files_are_detected_deleted_and_counted(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    await tier.put(b"a", b"A" * 100)
    await tier.put(b"b", b"B" * 100)
    pa, pb = tier._path(b"a"), tier._path(b"b")
    tmp = pa.with_suffix(".swap")
    os.replace(pa, tmp)
    os.replace(pb, pa)
    os.replace(tmp, pb)
    assert await tier.get(b"a") is None
    assert await tier.get(b"b") is None
    assert tier.counters.verification_failures == 2
    assert files(tmp_path) == []


async def test_a_half_written_temporary_file_is_never_visible_and_is_cleaned_at_start(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    (tmp_path / "tmp" / "leftover.1234").write_bytes(record.encode(b"\x07default" + b"x", b"partial")[:10])
    again = await opened(tmp_path)
    assert again.usage().entries == 0
    assert list((tmp_path / "tmp").iterdir()) == []
    assert tier.usage().entries == 0


async def test_a_broken_directory_raises_tier_failure_and_ping_reports_it(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    shutil.rmtree(tmp_path / "tmp")
    (tmp_path / "tmp").write_text("not a directory")  # writes now fail, even as root
    with pytest.raises(TierFailure, match="disk tier: write failed"):
        await tier.put(b"k", b"v")
    with pytest.raises(TierFailure, match="not writable"):
        await tier.ping()
    assert tier.usage().used_bytes == 0, "a failed write releases its reserved space"
