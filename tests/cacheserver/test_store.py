"""The tiered store with real tiers: promotion, write-behind, degradation, recovery."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
import xxhash
from prometheus_client import CollectorRegistry

from kvtier.cacheserver.core import YIELD_EVERY_KEYS, RequestCore
from kvtier.cacheserver.disk import DiskTier
from kvtier.cacheserver.errors import ChecksumMismatch
from kvtier.cacheserver.metrics import ServerMetrics
from kvtier.cacheserver.namespace import DEFAULT_TENANT, scoped
from kvtier.cacheserver.ram import RamTier
from kvtier.cacheserver.settings import Settings
from kvtier.cacheserver.store import StorePolicy, TieredStore


async def make_store(tmp_path: Path, **policy: object) -> tuple[TieredStore, RamTier, DiskTier, ServerMetrics]:
    ram = RamTier(1 << 20)
    disk = DiskTier(tmp_path, 100 << 20)
    await disk.open()
    metrics = ServerMetrics(CollectorRegistry())
    store = TieredStore([ram, disk], StorePolicy(probe_interval_s=0.1, **policy), metrics)  # type: ignore[arg-type]
    store.start()
    return store, ram, disk, metrics


def sample(metrics: ServerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def test_writes_reach_the_disk_behind_the_ram(tmp_path: Path) -> None:
    store, _ram, disk, _ = await make_store(tmp_path)
    assert await store.put(b"k", b"v" * 100)
    assert await store.drain(5)
    assert (await disk.contains([b"k"])) == [True]
    await store.close()


async def test_a_disk_hit_is_promoted_into_ram(tmp_path: Path) -> None:
    store, ram, disk, metrics = await make_store(tmp_path)
    await disk.put(b"k", b"from disk")
    got = await store.get(b"k")
    assert got is not None and bytes(got) == b"from disk"
    assert (await ram.contains([b"k"])) == [True]
    assert sample(metrics, "kvtier_tier_promotions_total", tier="ram") == 1
    await store.close()


async def test_lookup_counts_a_prefix_spread_over_tiers(tmp_path: Path) -> None:
    store, ram, disk, _ = await make_store(tmp_path)
    await ram.put(b"a", b"1")
    await disk.put(b"b", b"2")
    await ram.put(b"d", b"4")
    assert await store.lookup([b"a", b"b", b"c", b"d"]) == 2
    await store.close()


async def test_a_full_write_behind_queue_drops_copies_and_counts_them(tmp_path: Path) -> None:
    store, ram, _disk, metrics = await make_store(tmp_path, write_behind_values=2)
    ram.capacity_bytes = 10 << 20
    # Many concurrent puts: the disk writer copies one value at a time in a thread.
    results = await asyncio.gather(*(store.put(b"k%d" % i, b"v" * 200_000) for i in range(5)))
    assert all(results), "RAM holds every value even when its disk copy is dropped"
    assert sample(metrics, "kvtier_write_behind_dropped_total", tier="disk") >= 1
    assert (await ram.contains([b"k4"])) == [True]
    await store.close()


async def test_delete_also_cancels_a_pending_write_behind_copy(tmp_path: Path) -> None:
    store, _ram, disk, _ = await make_store(tmp_path)
    await store.put(b"gone", b"v")
    await store.delete([b"gone"])
    await store.drain(5)
    assert (await disk.contains([b"gone"])) == [False]
    assert await store.get(b"gone") is None
    await store.close()


async def test_a_failing_disk_costs_misses_then_recovers_by_itself(tmp_path: Path) -> None:
    store, _ram, disk, metrics = await make_store(tmp_path)
    shutil.rmtree(tmp_path / "tmp")
    (tmp_path / "tmp").write_text("broken")
    await store.put(b"k", b"v")
    await store.drain(5)
    assert not store.is_healthy("disk")
    assert sample(metrics, "kvtier_tier_errors_total", tier="disk", op="put") == 1
    assert await store.get(b"k") is not None, "RAM still serves"
    assert await store.get(b"other") is None
    (tmp_path / "tmp").unlink()
    (tmp_path / "tmp").mkdir()
    for _ in range(50):
        if store.is_healthy("disk"):
            break
        await asyncio.sleep(0.1)
    assert store.is_healthy("disk")
    await store.put(b"k2", b"v2")
    await store.drain(5)
    assert (await disk.contains([b"k2"])) == [True]
    await store.close()


async def test_write_through_puts_return_after_every_tier_holds_the_value(tmp_path: Path) -> None:
    store, _ram, disk, _ = await make_store(tmp_path, write_through=True)
    await store.put(b"k", b"v")
    assert (await disk.contains([b"k"])) == [True]
    await store.close()


async def test_a_value_only_the_disk_takes_is_written_from_its_source_when_written_through(tmp_path: Path) -> None:
    big = os.urandom(2 << 20)  # larger than the 1 MiB RAM tier
    crc = xxhash.xxh3_64_intdigest(big)
    store, ram, disk, _ = await make_store(tmp_path / "through", write_through=True)
    assert await store.put_checked(b"big", memoryview(big), crc) is True
    assert (await disk.contains([b"big"])) == [True] and ram.usage().entries == 0
    with pytest.raises(ChecksumMismatch):
        await store.put_checked(b"bad", memoryview(big), crc ^ 1)
    assert (await disk.contains([b"bad"])) == [False]
    # The RAM tier takes a small value: the caller copies it (None), as it does when the
    # disk is written behind (the copy waits in memory).
    assert await store.put_checked(b"small", memoryview(b"v" * 100), xxhash.xxh3_64_intdigest(b"v" * 100)) is None
    await store.close()
    behind, _, _, _ = await make_store(tmp_path / "behind")
    assert await behind.put_checked(b"big", memoryview(big), crc) is None
    await behind.close()


async def test_a_value_too_large_for_ram_replaces_an_older_one_held_there(tmp_path: Path) -> None:
    big = os.urandom(2 << 20)  # larger than the 1 MiB RAM tier
    for how in ("put", "put_checked"):
        store, ram, _disk, _ = await make_store(tmp_path / how, write_through=True)
        assert await store.put(b"k", b"small")
        assert ram.usage().entries == 1
        if how == "put":
            assert await store.put(b"k", big)
        else:
            assert await store.put_checked(b"k", memoryview(big), xxhash.xxh3_64_intdigest(big))
        got = await store.get(b"k")
        assert got is not None and bytes(got) == big, how
        await store.close()


class GatedDisk(DiskTier):
    """A real disk tier whose writes wait for ``gate`` (a slow disk, held at will)."""

    def __init__(self, directory: Path, capacity: int) -> None:
        super().__init__(directory, capacity)
        self.gate = asyncio.Event()
        self.writing = asyncio.Event()

    async def put(self, key: bytes, value: bytes | memoryview) -> bool:
        self.writing.set()
        await self.gate.wait()
        return await super().put(key, value)


async def test_a_lower_tier_call_past_the_tier_timeout_fails_that_tier_and_a_cancel_from_outside_does_not(
    tmp_path: Path,
) -> None:
    """The store's own deadline (``tier_timeout_s``), not the tier's: a disk write that
    hangs is given up after the deadline, the disk tier counted failing and the RAM
    copy kept; a caller cancelled from outside while a tier call is under way is
    cancelled (not a timeout) and the tier stays healthy."""
    ram = RamTier(1 << 20)
    disk = GatedDisk(tmp_path, 100 << 20)
    await disk.open()
    metrics = ServerMetrics(CollectorRegistry())
    policy = StorePolicy(write_through=True, tier_timeout_s=0.2, probe_interval_s=60)
    store = TieredStore([ram, disk], policy, metrics)
    store.start()
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await asyncio.wait_for(store.put(b"hung", b"v" * 1000), 10), "RAM holds it"
        assert 0.2 <= loop.time() - started < 2
        assert not store.is_healthy("disk")
        assert sample(metrics, "kvtier_tier_errors_total", tier="disk", op="put") == 1
        got = await store.get(b"hung")
        assert got is not None and bytes(got) == b"v" * 1000

        disk2 = GatedDisk(tmp_path / "second", 100 << 20)
        await disk2.open()
        metrics2 = ServerMetrics(CollectorRegistry())
        slow = StorePolicy(write_through=True, tier_timeout_s=30, probe_interval_s=60)
        store2 = TieredStore([RamTier(1 << 20), disk2], slow, metrics2)
        store2.start()
        try:
            put = asyncio.ensure_future(store2.put(b"k", b"v"))
            await asyncio.wait_for(disk2.writing.wait(), 5)
            put.cancel()
            with pytest.raises(asyncio.CancelledError):
                await put
            assert store2.is_healthy("disk")
            assert sample(metrics2, "kvtier_tier_errors_total", tier="disk", op="put") == 0
        finally:
            disk2.gate.set()
            await store2.close()
    finally:
        disk.gate.set()
        await store.close()


async def test_a_value_evicted_from_ram_while_its_disk_copy_is_being_written_is_still_found(tmp_path: Path) -> None:
    ram = RamTier(1 << 20)
    disk = GatedDisk(tmp_path, 100 << 20)
    await disk.open()
    store = TieredStore([ram, disk], StorePolicy(probe_interval_s=0.1), ServerMetrics(CollectorRegistry()))
    store.start()
    try:
        value = b"v" * 300_000
        assert await store.put(b"k", value)
        await asyncio.wait_for(disk.writing.wait(), 5)  # the copy is taken: in flight, not pending
        await ram.delete([b"k"])  # RAM evicts it before the disk holds it
        got = await store.get(b"k")
        assert got is not None and bytes(got) == value
        assert await store.lookup([b"k"]) == 1
        disk.gate.set()
        assert await store.drain(5)
        got = await store.get(b"k")
        assert got is not None and bytes(got) == value
    finally:
        disk.gate.set()
        await store.close()


async def test_a_get_of_many_ram_hits_gives_other_connections_a_turn_between_its_keys() -> None:
    """A RAM hit never waits, so nothing in a Get's path gives up the event loop by
    itself: the request core does, every ``YIELD_EVERY_KEYS`` keys."""
    metrics = ServerMetrics(CollectorRegistry())
    store = TieredStore([RamTier(64 << 20)], StorePolicy(), metrics)
    core = RequestCore(store, Settings(), metrics)
    keys = [b"k%d" % i for i in range(1000)]
    for key in keys:
        assert await store.put(scoped(DEFAULT_TENANT, key), b"v")
    turns = 0

    async def other_connection() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.ensure_future(other_connection())
    await asyncio.sleep(0)
    before = turns
    try:
        got = [value async for _, value in core.get(DEFAULT_TENANT, keys, False)]
    finally:
        other.cancel()
    assert got == [b"v"] * len(keys)
    assert turns - before >= len(keys) // YIELD_EVERY_KEYS - 1
