"""A disk tier whose filesystem fills up before --disk-bytes: a real server on a
4 MiB tmpfs (its own mount namespace), told it may use 1 GiB."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.connector.client import TierClient
from kvtier.testing.tierproc import TierProcess

FS_BYTES = 4 << 20
VALUE = 512 << 10  # seven values and a bit fill the filesystem


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[TierProcess]:
    tier = TierProcess.start(tmp_path / "tier", "--ram-bytes", "1MiB", disk_fs_bytes=FS_BYTES)
    yield tier
    tier.stop()


def _wait_written_behind(tier: TierProcess) -> None:
    deadline = time.monotonic() + 20
    while tier.metric("kvtier_write_behind_queue_depth") > 0:
        assert time.monotonic() < deadline, "write-behind queue never drained"
        time.sleep(0.05)


def _disk_files(tier: TierProcess) -> tuple[int, int, list[Path]]:
    records = [p for p in (tier.disk_view / "v1").rglob("*") if p.is_file()]
    leftovers = list((tier.disk_view / "tmp").iterdir())
    return len(records), sum(p.stat().st_size for p in records), leftovers


def test_a_filesystem_full_before_disk_bytes_lowers_the_capacity_and_keeps_serving(tier: TierProcess) -> None:
    values = {b"k%02d" % i: os.urandom(VALUE) for i in range(24)}
    with TierClient(tier.target, timeout_s=10) as client:
        for key, data in values.items():
            assert client.put([(key, data)]) == 1, "a full disk never fails a Put"
            _wait_written_behind(tier)

        # The disk tier ran out of filesystem, not of --disk-bytes: it stays healthy,
        # counts no failure, and now claims only what the filesystem held.
        assert tier.proc is not None and tier.proc.poll() is None
        assert tier.metric("kvtier_tier_healthy", tier="disk") == 1
        assert tier.metric("kvtier_tier_errors_total", tier="disk", op="put") == 0
        capacity = tier.metric("kvtier_tier_capacity_bytes", tier="disk")
        assert 2 * VALUE < capacity < FS_BYTES
        assert "capacity lowered" in tier.log.read_text()

        # The newest values that fit are on disk, whole; no half-written file is left.
        count, size, leftovers = _disk_files(tier)
        assert leftovers == []
        assert count >= 4 and size <= capacity
        assert tier.metric("kvtier_tier_entries", tier="disk") == count

        # Every Get is the exact value or a miss, never anything else; the newest
        # values (evicted from the 1 MiB RAM tier) come back from the disk.
        got = client.get(list(values), stop_at_first_miss=False)
        for (key, data), g in zip(values.items(), got, strict=True):
            assert g is None or bytes(g) == data, key
        assert all(g is not None for g in got[-4:])
        assert tier.metric("kvtier_tier_hits_total", tier="disk") >= 2
