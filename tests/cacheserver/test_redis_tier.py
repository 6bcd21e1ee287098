"""The Redis tier against real redis-server processes: TCP, unix socket, TLS, Cluster, faults."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from kvtier.cacheserver import record
from kvtier.cacheserver.errors import SettingsError, TierFailure
from kvtier.cacheserver.redis_tier import KEY_PREFIX, RedisTier
from kvtier.testing.redisprocs import RedisClusterProcs, RedisServer, TlsFiles

KEY = b"\x07default\x00chunk-key\xff"
VALUE = b"kv-bytes " * 100


def raw(server: RedisServer) -> redis.Redis:
    """A plain client on the server's unix socket, to look at and tamper with what is stored."""
    return redis.Redis(unix_socket_path=str(server.unix_socket), password=server.password)


@pytest.fixture
async def tier(redis_server: RedisServer) -> AsyncIterator[RedisTier]:
    t = RedisTier(redis_server.url)
    yield t
    await t.close()


# --- round trips -------------------------------------------------------------


async def test_value_put_over_tcp_is_read_back(tier: RedisTier) -> None:
    assert await tier.put(KEY, VALUE)
    assert await tier.get(KEY) == VALUE


async def test_value_put_over_a_unix_socket_is_read_back(redis_unix: RedisServer) -> None:
    t = RedisTier(redis_unix.unix_url)
    try:
        await t.put(KEY, VALUE)
        assert await t.get(KEY) == VALUE
    finally:
        await t.close()


async def test_value_put_over_tls_is_read_back(redis_tls: RedisServer, tls_files: TlsFiles) -> None:
    t = RedisTier(redis_tls.tls_url, tls_ca_file=str(tls_files.ca))
    try:
        await t.put(KEY, VALUE)
        assert await t.get(KEY) == VALUE
    finally:
        await t.close()


async def test_tls_client_certificate_is_accepted_by_a_server_that_requires_one(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    server = RedisServer.start(
        tmp_path / "mtls", tcp=False, tls=tls_files, config={"tls-auth-clients": "yes"}
    )
    t = RedisTier(
        server.tls_url,
        tls_ca_file=str(tls_files.ca),
        tls_cert_file=str(tls_files.client_cert),
        tls_key_file=str(tls_files.client_key),
    )
    try:
        await t.put(KEY, VALUE)
        assert await t.get(KEY) == VALUE
    finally:
        await t.close()
        server.stop()


async def test_tls_server_with_an_untrusted_certificate_raises_tier_failure(
    redis_tls: RedisServer,
) -> None:
    t = RedisTier(redis_tls.tls_url)  # the system CA store does not know the test CA
    try:
        with pytest.raises(TierFailure):
            await t.get(KEY)
    finally:
        await t.close()


async def test_missing_key_is_a_miss(tier: RedisTier) -> None:
    assert await tier.get(KEY) is None


async def test_hits_and_misses_are_counted(tier: RedisTier) -> None:
    await tier.put(KEY, VALUE)
    await tier.get(KEY)
    await tier.get(b"other")
    assert (tier.counters.hits, tier.counters.misses) == (1, 1)


async def test_put_replaces_the_previous_value(tier: RedisTier) -> None:
    await tier.put(KEY, b"old")
    await tier.put(KEY, b"new")
    assert await tier.get(KEY) == b"new"


async def test_memoryview_value_round_trips(tier: RedisTier) -> None:
    await tier.put(KEY, memoryview(bytearray(VALUE))[10:])
    assert await tier.get(KEY) == VALUE[10:]


async def test_64_mib_value_round_trips(redis_server: RedisServer) -> None:
    # The timeout bounds each transfer; give this noisy machine room to move 64 MiB.
    t = RedisTier(redis_server.url, timeout_s=5.0)
    value = os.urandom(1024) * (64 * 1024)
    try:
        await t.put(KEY, value)
        assert await t.get(KEY) == value
    finally:
        await t.close()


async def test_binary_key_is_stored_under_the_kvtier_prefix(
    tier: RedisTier, redis_server: RedisServer
) -> None:
    await tier.put(KEY, VALUE)
    with raw(redis_server) as r:
        assert r.keys() == [KEY_PREFIX + KEY]


async def test_stored_value_is_a_verifiable_record(
    tier: RedisTier, redis_server: RedisServer
) -> None:
    await tier.put(KEY, VALUE)
    with raw(redis_server) as r:
        assert record.decode(KEY, r.get(KEY_PREFIX + KEY)) == VALUE


async def test_contains_reports_each_key_in_order(tier: RedisTier) -> None:
    await tier.put(b"a", VALUE)
    await tier.put(b"c", VALUE)
    assert await tier.contains([b"a", b"b", b"c", b"d"]) == [True, False, True, False]


async def test_contains_of_no_keys_is_empty(tier: RedisTier) -> None:
    assert await tier.contains([]) == []


async def test_delete_returns_how_many_keys_were_present(tier: RedisTier) -> None:
    await tier.put(b"a", VALUE)
    await tier.put(b"b", VALUE)
    assert await tier.delete([b"a", b"b", b"missing"]) == 2


async def test_deleted_key_is_a_miss(tier: RedisTier) -> None:
    await tier.put(KEY, VALUE)
    await tier.delete([KEY])
    assert await tier.get(KEY) is None


async def test_put_with_a_ttl_sets_an_expiry(redis_server: RedisServer) -> None:
    t = RedisTier(redis_server.url, ttl_s=60)
    try:
        await t.put(KEY, VALUE)
    finally:
        await t.close()
    with raw(redis_server) as r:
        assert 0 < r.ttl(KEY_PREFIX + KEY) <= 60


async def test_put_without_a_ttl_sets_no_expiry(tier: RedisTier, redis_server: RedisServer) -> None:
    await tier.put(KEY, VALUE)
    with raw(redis_server) as r:
        assert r.ttl(KEY_PREFIX + KEY) == -1


# --- passwords and URLs ------------------------------------------------------


@pytest.fixture
def redis_with_password(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer.start(tmp_path / "redis-auth", password="s3cret")
    yield server
    server.stop()


async def test_password_in_the_url_authenticates(redis_with_password: RedisServer) -> None:
    t = RedisTier(f"redis://:s3cret@127.0.0.1:{redis_with_password.port}/0")
    try:
        assert await t.put(KEY, VALUE)
    finally:
        await t.close()


async def test_password_argument_authenticates(redis_with_password: RedisServer) -> None:
    t = RedisTier(redis_with_password.url, password="s3cret")
    try:
        assert await t.put(KEY, VALUE)
    finally:
        await t.close()


async def test_password_argument_wins_over_the_url(redis_with_password: RedisServer) -> None:
    t = RedisTier(f"redis://:wrong@127.0.0.1:{redis_with_password.port}", password="s3cret")
    try:
        assert await t.put(KEY, VALUE)
    finally:
        await t.close()


async def test_wrong_password_raises_tier_failure(redis_with_password: RedisServer) -> None:
    t = RedisTier(redis_with_password.url, password="wrong")
    try:
        with pytest.raises(TierFailure):
            await t.get(KEY)
    finally:
        await t.close()


async def test_url_db_number_selects_the_database(redis_server: RedisServer) -> None:
    t = RedisTier(redis_server.url + "/3")
    try:
        await t.put(KEY, VALUE)
    finally:
        await t.close()
    sock = str(redis_server.unix_socket)
    with redis.Redis(unix_socket_path=sock) as db0, redis.Redis(unix_socket_path=sock, db=3) as db3:
        assert (db0.dbsize(), db3.dbsize()) == (0, 1)


def test_unknown_url_scheme_is_rejected_naming_the_accepted_schemes() -> None:
    with pytest.raises(SettingsError, match=r"redis\+cluster://"):
        RedisTier("http://127.0.0.1:6379")


def test_rejected_url_does_not_echo_its_password() -> None:
    with pytest.raises(SettingsError) as err:
        RedisTier("memcached://:hunter2@127.0.0.1:6379")
    assert "hunter2" not in str(err.value)


def test_tls_files_need_a_rediss_url() -> None:
    with pytest.raises(SettingsError, match="rediss://"):
        RedisTier("redis://127.0.0.1:6379", tls_ca_file="/tmp/ca.crt")


def test_cluster_url_needs_host_and_port_seeds() -> None:
    with pytest.raises(SettingsError, match="host:port"):
        RedisTier("redis+cluster://127.0.0.1")


# --- corrupt records ---------------------------------------------------------


def _flip_a_byte(blob: bytes, other: bytes) -> bytes:
    i = len(blob) - 5
    return blob[:i] + bytes([blob[i] ^ 0x01]) + blob[i + 1 :]


def _truncate(blob: bytes, other: bytes) -> bytes:
    return blob[:-7]


def _swap(blob: bytes, other: bytes) -> bytes:
    return other  # the (valid) record of another key


def _garbage(blob: bytes, other: bytes) -> bytes:
    return b"this is not a kvtier record at all"


def _empty(blob: bytes, other: bytes) -> bytes:
    return b""


CORRUPTIONS = [_flip_a_byte, _truncate, _swap, _garbage, _empty]
Corruption = Callable[[bytes, bytes], bytes]


async def _corrupt(tier: RedisTier, server: RedisServer, corruption: Corruption) -> None:
    """Stores KEY and OTHER, then overwrites KEY's record in Redis with a corrupted one."""
    await tier.put(KEY, VALUE)
    await tier.put(b"other", b"another value of the same length." * 27)
    with raw(server) as r:
        blob, other = r.get(KEY_PREFIX + KEY), r.get(KEY_PREFIX + b"other")
        r.set(KEY_PREFIX + KEY, corruption(blob, other))


@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=lambda c: c.__name__.strip("_"))
async def test_corrupt_record_is_a_miss(
    tier: RedisTier, redis_server: RedisServer, corruption: Corruption
) -> None:
    await _corrupt(tier, redis_server, corruption)
    assert await tier.get(KEY) is None


@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=lambda c: c.__name__.strip("_"))
async def test_corrupt_record_is_deleted(
    tier: RedisTier, redis_server: RedisServer, corruption: Corruption
) -> None:
    await _corrupt(tier, redis_server, corruption)
    await tier.get(KEY)
    with raw(redis_server) as r:
        assert r.exists(KEY_PREFIX + KEY) == 0


@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=lambda c: c.__name__.strip("_"))
async def test_corrupt_record_is_counted_as_a_verification_failure(
    tier: RedisTier, redis_server: RedisServer, corruption: Corruption
) -> None:
    await _corrupt(tier, redis_server, corruption)
    await tier.get(KEY)
    assert tier.counters.verification_failures == 1


async def test_swapped_records_leave_the_other_key_readable(
    tier: RedisTier, redis_server: RedisServer
) -> None:
    await _corrupt(tier, redis_server, _swap)
    await tier.get(KEY)
    assert await tier.get(b"other") is not None


# --- usage and capacity ------------------------------------------------------


async def test_usage_is_zero_before_redis_was_asked(tier: RedisTier) -> None:
    assert (tier.usage().used_bytes, tier.usage().entries) == (0, 0)


async def test_ping_refreshes_the_entry_count(tier: RedisTier) -> None:
    for i in range(3):
        await tier.put(b"k%d" % i, VALUE)
    await tier.ping()
    assert tier.usage().entries == 3


async def test_ping_reports_redis_used_memory(tier: RedisTier) -> None:
    await tier.put(KEY, bytes(1 << 20))
    await tier.ping()
    assert tier.usage().used_bytes > 1 << 20


async def test_capacity_is_zero_without_maxmemory(tier: RedisTier) -> None:
    await tier.ping()
    assert tier.usage().capacity_bytes == 0


async def test_capacity_is_redis_maxmemory(tmp_path: Path) -> None:
    server = RedisServer.start(tmp_path / "r", config={"maxmemory": "64mb"})
    t = RedisTier(server.url)
    try:
        await t.ping()
        assert t.usage().capacity_bytes == 64 * 1024 * 1024
    finally:
        await t.close()
        server.stop()


async def entries_become(tier: RedisTier, n: int, within_s: float) -> int:
    """The tier's entries (as it last read them) once they are ``n``, or after ``within_s``."""
    deadline = time.monotonic() + within_s
    while tier.usage().entries != n and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)  # (polled: the tier has no event to wait on)
    return tier.usage().entries


async def test_usage_refreshes_in_the_background_while_calls_flow(tier: RedisTier) -> None:
    tier.stats_interval_s = 0.0
    await tier.put(KEY, VALUE)
    assert await entries_become(tier, 1, within_s=1.0) == 1


async def test_usage_read_after_the_last_calls_once_the_interval_is_up(tier: RedisTier) -> None:
    """A burst of calls inside one interval: the first call's read is not the last one, so
    a tier that goes idle after the burst shows what it holds then (Grafana's entries
    gauge stayed at the burst's first read before)."""
    tier.stats_interval_s = 2.0
    await tier.put(b"k0", VALUE)
    assert await entries_become(tier, 1, within_s=2.0) == 1  # the first call's read: at once
    for i in range(1, 4):  # inside the interval, then nothing more
        await tier.put(b"k%d" % i, VALUE)
    assert tier.usage().entries == 1  # not read again yet: at most one read per interval
    assert await entries_become(tier, 4, within_s=6.0) == 4
    assert await tier.delete([b"k0", b"k1"]) == 2  # a Delete is followed by a read too
    assert await entries_become(tier, 2, within_s=6.0) == 2


async def test_a_call_that_ends_after_close_starts_no_stats_read(redis_server: RedisServer) -> None:
    t = RedisTier(redis_server.url, stats_interval_s=0.0)
    put = asyncio.ensure_future(t.put(KEY, VALUE))
    await asyncio.sleep(0)  # under way
    await t.close()
    with contextlib.suppress(TierFailure):
        await put  # ends after close(), stored or failed
    assert t._stats_task is None or t._stats_task.done()


async def test_evictions_by_redis_are_counted(tmp_path: Path) -> None:
    server = RedisServer.start(
        tmp_path / "r", config={"maxmemory": "4mb", "maxmemory-policy": "allkeys-lru"}
    )
    t = RedisTier(server.url)
    try:
        for i in range(40):
            await t.put(b"k%d" % i, bytes(256 * 1024))
        await t.ping()
        assert t.counters.evictions > 0
    finally:
        await t.close()
        server.stop()


async def test_value_larger_than_maxmemory_is_not_stored(tmp_path: Path) -> None:
    server = RedisServer.start(tmp_path / "r", config={"maxmemory": "4mb"})
    t = RedisTier(server.url)
    try:
        await t.ping()
        assert not await t.put(KEY, bytes(5 * 1024 * 1024))
    finally:
        await t.close()
        server.stop()


async def test_put_into_a_full_redis_that_does_not_evict_returns_false(tmp_path: Path) -> None:
    server = RedisServer.start(
        tmp_path / "r", config={"maxmemory": "4mb", "maxmemory-policy": "noeviction"}
    )
    t = RedisTier(server.url)
    try:
        stored = [await t.put(b"k%d" % i, bytes(256 * 1024)) for i in range(40)]
        assert stored[0] and not stored[-1]
    finally:
        await t.close()
        server.stop()


# --- faults --------------------------------------------------------------------


async def _load(t: RedisTier, stop: asyncio.Event, log: list[tuple[float, float, str]]) -> None:
    """Puts and gets until ``stop``; logs (start, end, outcome) of every call."""
    i = 0
    while not stop.is_set():
        i += 1
        start = time.monotonic()
        try:
            await (t.put(b"load%d" % (i % 50), VALUE) if i % 2 else t.get(b"load%d" % (i % 50)))
            outcome = "ok"
        except TierFailure:
            outcome = "TierFailure"
        log.append((start, time.monotonic(), outcome))
        await asyncio.sleep(0)


async def test_stopped_redis_fails_calls_within_the_timeout(redis_server: RedisServer) -> None:
    timeout_s = 0.3
    t = RedisTier(redis_server.url, timeout_s=timeout_s)
    stop = asyncio.Event()
    log: list[tuple[float, float, str]] = []
    workers = [asyncio.create_task(_load(t, stop, log)) for _ in range(4)]
    try:
        await asyncio.sleep(0.2)
        redis_server.pause()
        paused_at = time.monotonic()
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), 5)
    finally:
        redis_server.resume()
        await t.close()
    during = [(end - start, outcome) for start, end, outcome in log if end > paused_at + 0.05]
    assert during and all(o == "TierFailure" and d < timeout_s + 0.4 for d, o in during), during


async def test_resumed_redis_serves_the_same_tier_again(redis_server: RedisServer) -> None:
    t = RedisTier(redis_server.url, timeout_s=0.3)
    try:
        await t.put(KEY, VALUE)
        redis_server.pause()
        with pytest.raises(TierFailure):
            await t.get(KEY)
        redis_server.resume()
        assert await t.get(KEY) == VALUE
    finally:
        redis_server.resume()
        await t.close()


async def test_killed_redis_fails_calls_at_once(redis_server: RedisServer) -> None:
    t = RedisTier(redis_server.url, timeout_s=2.0)
    try:
        await t.put(KEY, VALUE)
        redis_server.kill()
        start = time.monotonic()
        with pytest.raises(TierFailure):
            await t.get(KEY)
        assert time.monotonic() - start < 1.0
    finally:
        await t.close()


async def test_restarted_redis_serves_the_same_tier_again(redis_server: RedisServer) -> None:
    t = RedisTier(redis_server.url)
    try:
        await t.put(KEY, VALUE)  # leaves connections in the pool
        redis_server.kill()
        with pytest.raises(TierFailure):
            await t.put(KEY, VALUE)
        redis_server.restart()
        assert await t.put(KEY, VALUE)
    finally:
        await t.close()


async def test_ping_raises_tier_failure_while_redis_is_down(
    tier: RedisTier, redis_server: RedisServer
) -> None:
    redis_server.kill()
    with pytest.raises(TierFailure):
        await tier.ping()


async def test_ping_succeeds_once_redis_is_back(tier: RedisTier, redis_server: RedisServer) -> None:
    await tier.ping()
    redis_server.kill()
    with pytest.raises(TierFailure):
        await tier.ping()
    redis_server.restart()
    await tier.ping()


async def test_tier_failure_message_names_no_key(
    tier: RedisTier, redis_server: RedisServer
) -> None:
    redis_server.kill()
    with pytest.raises(TierFailure) as err:
        await tier.contains([b"secret-prompt-key"])
    assert b"secret-prompt-key" not in str(err.value).encode()


# --- Redis Cluster -------------------------------------------------------------

CLUSTER_KEYS = [b"chunk-%03d" % i for i in range(60)]


@pytest.fixture
async def cluster_tier(redis_cluster: RedisClusterProcs) -> AsyncIterator[RedisTier]:
    t = RedisTier(redis_cluster.url, timeout_s=0.5)
    yield t
    await t.close()


async def test_cluster_spreads_values_over_every_primary(
    cluster_tier: RedisTier, redis_cluster: RedisClusterProcs
) -> None:
    for key in CLUSTER_KEYS:
        await cluster_tier.put(key, VALUE)
    assert all(int(m.cli("DBSIZE")) > 0 for m in redis_cluster.masters())


async def test_cluster_values_round_trip(cluster_tier: RedisTier) -> None:
    for key in CLUSTER_KEYS:
        await cluster_tier.put(key, key * 10)
    assert [await cluster_tier.get(k) for k in CLUSTER_KEYS] == [k * 10 for k in CLUSTER_KEYS]


async def test_cluster_contains_is_correct_across_slots(cluster_tier: RedisTier) -> None:
    stored = CLUSTER_KEYS[::2]
    assert len({key_slot(KEY_PREFIX + k) for k in stored}) > 10
    for key in stored:
        await cluster_tier.put(key, VALUE)
    assert await cluster_tier.contains(CLUSTER_KEYS) == [k in stored for k in CLUSTER_KEYS]


async def test_cluster_delete_counts_present_keys_across_slots(cluster_tier: RedisTier) -> None:
    for key in CLUSTER_KEYS[:20]:
        await cluster_tier.put(key, VALUE)
    assert await cluster_tier.delete(CLUSTER_KEYS) == 20


async def test_cluster_usage_sums_the_primaries(cluster_tier: RedisTier) -> None:
    for key in CLUSTER_KEYS:
        await cluster_tier.put(key, VALUE)
    await cluster_tier.ping()
    assert cluster_tier.usage().entries == len(CLUSTER_KEYS)


async def test_cluster_tier_recovers_after_a_primary_is_killed(
    cluster_tier: RedisTier, redis_cluster: RedisClusterProcs
) -> None:
    await cluster_tier.put(KEY, VALUE)
    redis_cluster.master_of(KEY_PREFIX + KEY).kill()
    deadline = time.monotonic() + 20
    while True:
        try:
            # Each call fails fast while the replica is not yet promoted; none may hang.
            if await asyncio.wait_for(cluster_tier.put(KEY, b"after failover"), 5):
                break
        except TierFailure:
            assert time.monotonic() < deadline, "the tier did not recover after the failover"
            await asyncio.sleep(0.2)
    assert await cluster_tier.get(KEY) == b"after failover"


async def test_cluster_password_in_the_url_authenticates(tmp_path: Path) -> None:
    cluster = RedisClusterProcs.start(tmp_path / "cluster-auth", password="s3cret")
    t = RedisTier(cluster.url.replace("://", "://:s3cret@"))
    try:
        await t.put(KEY, VALUE)
        assert await t.get(KEY) == VALUE
    finally:
        await t.close()
        cluster.stop()
