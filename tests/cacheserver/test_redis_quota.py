"""Per-tenant byte quotas in the Redis tier (issue 21, item 3), against real redis-server processes.

A tenant at its quota evicts its own least recently used entries, never another
tenant's; the ledger lives in Redis, so tier processes sharing one Redis share it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from kvtier.cacheserver import record
from kvtier.cacheserver.namespace import scoped
from kvtier.cacheserver.redis_tier import KEY_PREFIX, RedisTier
from kvtier.connector.client import TierClient
from kvtier.testing.redisprocs import RedisClusterProcs, RedisServer
from kvtier.testing.tierproc import TierProcess

VALUE = os.urandom(10_000)
RECORD = record.HEADER_SIZE + len(scoped("a", b"k00")) + len(VALUE)  # what one value is charged
QUOTA = 3 * RECORD + 100  # three values of a tenant fit, the fourth evicts one


def key(tenant: str, i: int) -> bytes:
    return scoped(tenant, b"k%02d" % i)


@pytest.fixture
async def tier(redis_server: RedisServer) -> AsyncIterator[RedisTier]:
    t = RedisTier(redis_server.url, tenant_quota_bytes=QUOTA)
    yield t
    await t.close()


async def present(t: RedisTier, tenant: str, n: int) -> list[int]:
    found = await t.contains([key(tenant, i) for i in range(n)])
    return [i for i, hit in enumerate(found) if hit]


async def test_a_tenant_over_its_quota_loses_its_own_least_recently_used_values(tier: RedisTier) -> None:
    for i in range(6):
        assert await tier.put(key("a", i), VALUE)
    assert await present(tier, "a", 6) == [3, 4, 5]
    assert tier.counters.of("a").evictions == 3
    assert tier.tenant_usage("a").used_bytes == 3 * RECORD
    assert tier.tenant_usage("a").entries == 3


async def test_another_tenants_load_never_evicts_a_tenants_values(tier: RedisTier) -> None:
    for i in range(3):
        await tier.put(key("b", i), VALUE)
    for i in range(30):  # ten times tenant a's quota
        await tier.put(key("a", i), VALUE)
    assert await present(tier, "b", 3) == [0, 1, 2]
    assert tier.counters.of("b").evictions == 0


async def test_a_get_keeps_a_value_from_being_the_next_evicted(tier: RedisTier) -> None:
    for i in range(3):
        await tier.put(key("a", i), VALUE)
    assert await tier.get(key("a", 0)) == VALUE  # now the most recently used
    await tier.put(key("a", 3), VALUE)
    assert await present(tier, "a", 4) == [0, 2, 3]


async def test_a_delete_or_an_overwrite_frees_the_tenants_bytes(tier: RedisTier) -> None:
    for i in range(3):
        await tier.put(key("a", i), VALUE)
    await tier.put(key("a", 0), VALUE)  # the same key again: charged once
    assert tier.tenant_usage("a").used_bytes == 3 * RECORD
    assert await tier.delete([key("a", 1), key("a", 2)]) == 2
    assert tier.tenant_usage("a").used_bytes == RECORD
    await tier.put(key("a", 3), VALUE)
    await tier.put(key("a", 4), VALUE)
    assert await present(tier, "a", 5) == [0, 3, 4]
    assert tier.counters.of("a").evictions == 0


async def test_a_value_larger_than_the_quota_is_not_stored(tier: RedisTier) -> None:
    assert not await tier.put(key("a", 0), os.urandom(QUOTA))
    assert await tier.get(key("a", 0)) is None


async def test_the_ledger_is_shared_by_tiers_on_one_redis(tier: RedisTier, redis_server: RedisServer) -> None:
    other = RedisTier(redis_server.url, tenant_quota_bytes=QUOTA)
    try:
        await tier.put(key("a", 0), VALUE)
        await tier.put(key("a", 1), VALUE)
        await other.put(key("a", 2), VALUE)
        await other.put(key("a", 3), VALUE)  # the fourth of tenant a, whichever tier wrote it
        assert await present(tier, "a", 4) == [1, 2, 3]
        await tier.ping()  # reads every tenant's figures, the other tier's charges included
        assert tier.tenant_usage("a").entries == 3
    finally:
        await other.close()


async def test_without_a_quota_nothing_is_charged(redis_server: RedisServer) -> None:
    t = RedisTier(redis_server.url)
    try:
        for i in range(6):
            await t.put(key("a", i), VALUE)
        assert await present(t, "a", 6) == list(range(6))
        assert [k for k in redis_server.cli("KEYS", "*").split() if not k.startswith(KEY_PREFIX.decode())] == []
    finally:
        await t.close()


async def test_quotas_hold_on_a_redis_cluster(redis_cluster: RedisClusterProcs) -> None:
    t = RedisTier(redis_cluster.url, tenant_quota_bytes=QUOTA)
    try:
        for i in range(3):
            await t.put(key("b", i), VALUE)
        for i in range(20):  # tenant a's keys spread over every primary; its ledger is one slot
            await t.put(key("a", i), VALUE)
        assert await present(t, "a", 20) == [17, 18, 19]
        assert await present(t, "b", 3) == [0, 1, 2]
    finally:
        await t.close()


def test_a_tenant_at_its_quota_evicts_its_own_redis_entries_never_anothers(
    start_tier: Callable[..., TierProcess], redis_server: RedisServer, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "team-a").write_text("a" * 24 + "-tenant-a-token")
    (tokens / "team-b").write_text("b" * 24 + "-tenant-b-token")
    flags = ("--auth-tokens", str(tokens), "--redis-url", redis_server.url, "--disk-bytes", "0",
             "--write-policy", "write-through", "--tenant-quota-bytes", "1MiB")  # fmt: skip
    tier = start_tier(*flags)
    with (
        TierClient(tier.target, token="a" * 24 + "-tenant-a-token", timeout_s=30) as a,
        TierClient(tier.target, token="b" * 24 + "-tenant-b-token", timeout_s=30) as b,
    ):
        b.put([(b"b%d" % i, os.urandom(100_000)) for i in range(5)])
        for i in range(40):  # 4 MB from tenant a: four times its quota, in RAM and in Redis
            a.put([(b"a%d" % i, os.urandom(100_000))])
    assert tier.metric("kvtier_tenant_used_bytes", tier="redis", tenant="team-a") <= 1 << 20
    assert tier.metric("kvtier_tenant_evictions_total", tier="redis", tenant="team-a") >= 29
    assert tier.metric("kvtier_tenant_evictions_total", tier="redis", tenant="team-b") == 0
    tier.restart()  # RAM empty: what is found now is in Redis
    with (
        TierClient(tier.target, token="a" * 24 + "-tenant-a-token", timeout_s=30) as a,
        TierClient(tier.target, token="b" * 24 + "-tenant-b-token", timeout_s=30) as b,
    ):
        assert b.lookup([b"b%d" % i for i in range(5)]) == 5
        assert a.lookup([b"a39"]) == 1 and a.lookup([b"a0"]) == 0
        assert 9 <= sum(a.lookup([b"a%d" % i]) for i in range(40)) <= 10
