"""A Get reads values of lower tiers ahead of the one it sends (``core.READ_AHEAD``), with
real tiers: a disk directory and a redis-server. What it must keep: values in request
order and exact, at most the record files it was allowed, none left open when the Get
ends early, and no read ahead of keys the RAM tier holds."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvtier.cacheserver.core import READ_AHEAD, RequestCore, no_auth
from kvtier.cacheserver.disk import DiskTier
from kvtier.cacheserver.metrics import ServerMetrics
from kvtier.cacheserver.namespace import DEFAULT_TENANT, scoped
from kvtier.cacheserver.ram import RamTier
from kvtier.cacheserver.record import RecordFile
from kvtier.cacheserver.redis_tier import RedisTier
from kvtier.cacheserver.settings import Settings
from kvtier.cacheserver.store import StorePolicy, TieredStore
from kvtier.cacheserver.tiers import Tier
from kvtier.testing.redisprocs import RedisServer

KEYS = [b"key-%02d" % i for i in range(12)]


async def make_core(lower: Tier, ram_bytes: int = 64 << 20) -> tuple[RequestCore, RamTier]:
    ram = RamTier(ram_bytes)
    metrics = ServerMetrics(CollectorRegistry())
    store = TieredStore([ram, lower], StorePolicy(probe_interval_s=0.1), metrics)
    store.start()
    return RequestCore(store, Settings(), metrics, no_auth), ram


async def disk_core(tmp_path: Path) -> tuple[RequestCore, RamTier, DiskTier, dict[bytes, bytes]]:
    disk = DiskTier(tmp_path / "disk", 1 << 30)
    await disk.open()
    values = {k: os.urandom(100_000 + i) for i, k in enumerate(KEYS)}
    for k, v in values.items():
        assert await disk.put(scoped(DEFAULT_TENANT, k), v)
    core, ram = await make_core(disk)
    return core, ram, disk, values


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_values_read_ahead_from_disk_come_in_request_order_and_exact(tmp_path: Path) -> None:
    core, _ram, _disk, values = await disk_core(tmp_path)
    try:
        got = [
            (i, bytes(v)) async for i, v in core.get(DEFAULT_TENANT, KEYS, False) if v is not None
        ]
        assert got == [(i, values[k]) for i, k in enumerate(KEYS)]
    finally:
        await core.store.close()


async def test_misses_between_lower_tier_hits_keep_their_places(tmp_path: Path) -> None:
    core, _ram, _disk, values = await disk_core(tmp_path)
    keys = [KEYS[0], b"absent-1", KEYS[1], b"absent-2", b"absent-3", KEYS[2]]
    try:
        got = [
            (i, None if v is None else bytes(v))
            async for i, v in core.get(DEFAULT_TENANT, keys, False)
        ]
        assert got == [
            (0, values[KEYS[0]]), (1, None), (2, values[KEYS[1]]),
            (3, None), (4, None), (5, values[KEYS[2]]),
        ]  # fmt: skip
    finally:
        await core.store.close()


async def test_no_more_record_files_than_allowed_and_the_rest_as_values(tmp_path: Path) -> None:
    core, _ram, _disk, values = await disk_core(tmp_path)
    try:
        got = [v async for _, v in core.get(DEFAULT_TENANT, KEYS, False, files=3)]
        files = [v for v in got if isinstance(v, RecordFile)]
        assert len(files) == 3
        assert [bytes(v) for v in got if not isinstance(v, RecordFile)] == [
            values[k] for k, v in zip(KEYS, got, strict=True) if not isinstance(v, RecordFile)
        ]
        for f in files:
            f.close()
    finally:
        await core.store.close()


async def test_a_get_stopped_at_its_first_miss_leaves_no_file_open(tmp_path: Path) -> None:
    core, _ram, _disk, _values = await disk_core(tmp_path)
    keys = [KEYS[0], b"absent", *KEYS[1:]]
    try:
        before = open_fds()
        got = [v async for _, v in core.get(DEFAULT_TENANT, keys, True, files=len(keys))]
        assert len(got) == 2 and isinstance(got[0], RecordFile) and got[1] is None
        got[0].close()
        await core.store.drain(5)  # the reads ahead of the miss, cancelled, close their files
        for _ in range(100):
            if open_fds() <= before:
                break
            await asyncio.sleep(0.01)
        assert open_fds() <= before
    finally:
        await core.store.close()


async def test_a_get_closed_by_its_edge_mid_way_leaves_no_file_open(tmp_path: Path) -> None:
    core, _ram, _disk, _values = await disk_core(tmp_path)
    try:
        before = open_fds()
        values = core.get(DEFAULT_TENANT, KEYS, False, files=len(KEYS))
        _, first = await anext(values)
        assert isinstance(first, RecordFile)
        first.close()
        await values.aclose()  # as an edge does when its client goes away
        for _ in range(100):
            if open_fds() <= before:
                break
            await asyncio.sleep(0.01)
        assert open_fds() <= before
    finally:
        await core.store.close()


async def test_redis_values_are_read_concurrently_at_most_read_ahead_plus_one(
    tmp_path: Path,
) -> None:
    server = RedisServer.start(tmp_path / "redis")
    redis_tier = RedisTier(server.url, timeout_s=5.0)
    try:
        values = {k: os.urandom(200_000) for k in KEYS}
        for k, v in values.items():
            assert await redis_tier.put(scoped(DEFAULT_TENANT, k), v)
        core, _ram = await make_core(redis_tier)
        assert redis_tier._bulk is not None and redis_tier._bulk._idle == []
        got = [bytes(v) async for _, v in core.get(DEFAULT_TENANT, KEYS, False) if v is not None]
        assert got == [values[k] for k in KEYS]
        # Each read in flight held a connection of the tier's own client: several at once,
        # never more than this key's and READ_AHEAD more.
        assert 2 <= len(redis_tier._bulk._idle) <= READ_AHEAD + 1
        await core.store.close()
    finally:
        server.stop()


async def test_keys_in_ram_are_not_read_ahead(tmp_path: Path) -> None:
    server = RedisServer.start(tmp_path / "redis")
    redis_tier = RedisTier(server.url, timeout_s=5.0)
    try:
        core, ram = await make_core(redis_tier)
        for k in KEYS:
            assert await ram.put(scoped(DEFAULT_TENANT, k), b"in ram " + k)
        got = [bytes(v) async for _, v in core.get(DEFAULT_TENANT, KEYS, False) if v is not None]
        assert got == [b"in ram " + k for k in KEYS]
        assert redis_tier._bulk is not None and redis_tier._bulk._idle == []  # Redis never asked
        await core.store.close()
    finally:
        server.stop()
