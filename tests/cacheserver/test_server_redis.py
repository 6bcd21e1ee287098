"""The tier process with a real Redis below it: sharing, faults, recovery."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from kvtier.connector.client import TierClient
from kvtier.testing.redisprocs import RedisClusterProcs, RedisServer, TlsFiles
from kvtier.testing.tierproc import TierProcess


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_two_tier_processes_share_values_through_redis(
    start_tier: Callable[..., TierProcess], redis_server: RedisServer
) -> None:
    a = start_tier("--redis-url", redis_server.url, "--disk-bytes", "0")
    b = start_tier("--redis-url", redis_server.url, "--disk-bytes", "0")
    data = os.urandom(300_000)
    with TierClient(a.target) as ca:
        ca.put([(b"shared", data)])
    with TierClient(b.target) as cb:
        assert _wait_for(lambda: cb.lookup([b"shared"]) == 1)
        (got,) = cb.get([b"shared"])
    assert got is not None and bytes(got) == data
    assert b.metric("kvtier_tier_hits_total", tier="redis") == 1
    assert b.metric("kvtier_tier_promotions_total", tier="ram") == 1


def test_a_killed_redis_costs_misses_not_failed_calls_and_the_tier_recovers(
    start_tier: Callable[..., TierProcess], redis_server: RedisServer
) -> None:
    tier = start_tier("--redis-url", redis_server.url, "--disk-bytes", "0", "--tier-timeout", "500ms")
    with TierClient(tier.target, timeout_s=5) as c:
        c.put([(b"before", b"v0")])
        redis_server.kill()
        for i in range(20):  # load while Redis is gone: every call still answers
            c.put([(b"during%d" % i, b"v")])
            assert c.lookup([b"before", b"during%d" % i]) == 2  # RAM still has both
            assert c.get([b"absent%d" % i]) == [None]
        assert tier.metric("kvtier_tier_healthy", tier="redis") == 0
        assert tier.metric("kvtier_tier_errors_total", tier="redis", op="put") >= 1 or tier.metric(
            "kvtier_tier_errors_total", tier="redis", op="get"
        ) >= 1
        redis_server.restart()
        assert _wait_for(lambda: tier.metric("kvtier_tier_healthy", tier="redis") == 1)
        c.put([(b"after", b"v1")])
    assert _wait_for(lambda: int(redis_server.cli("DBSIZE")) >= 1), "writes reach Redis again"
    assert "redis tier failing" in tier.log.read_text()
    assert "redis tier recovered" in tier.log.read_text()


def test_a_frozen_redis_never_stalls_calls_past_the_tier_timeout(
    start_tier: Callable[..., TierProcess], redis_server: RedisServer
) -> None:
    tier = start_tier(
        "--redis-url", redis_server.url, "--disk-bytes", "0", "--tier-timeout", "500ms", "--redis-timeout", "300ms"
    )
    with TierClient(tier.target, timeout_s=5) as c:
        c.put([(b"k", b"v")])
        redis_server.pause()
        try:
            for i in range(10):  # each call answers within its deadline (a stall would be TierUnavailable)
                c.put([(b"f%d" % i, b"v")])
                assert c.get([b"miss%d" % i]) == [None]
            assert tier.metric("kvtier_tier_healthy", tier="redis") == 0
            # Only the calls that met Redis before it was marked failing waited for
            # it (the write-behind copy and at most one Get); the rest skipped it.
            waited = sum(tier.metric("kvtier_tier_errors_total", tier="redis", op=op) for op in ("get", "put"))
            assert 1 <= waited <= 2
        finally:
            redis_server.resume()
        assert _wait_for(lambda: tier.metric("kvtier_tier_healthy", tier="redis") == 1)
        assert c.lookup([b"k"]) == 1
    assert tier.log.read_text().count("redis tier failing") == 1


def test_deletes_a_failing_redis_missed_are_replayed_before_it_serves_again(
    start_tier: Callable[..., TierProcess], redis_server: RedisServer
) -> None:
    tier = start_tier(
        "--redis-url", redis_server.url, "--disk-bytes", "0", "--tier-timeout", "500ms",
        "--redis-timeout", "300ms", "--write-policy", "write-through",
    )  # fmt: skip
    values = {key: os.urandom(10_000) for key in (b"gone-a", b"gone-b", b"kept")}
    with TierClient(tier.target, timeout_s=5) as c:
        assert c.put(list(values.items())) == 3
        assert int(redis_server.cli("DBSIZE")) == 3
        redis_server.pause()
        try:
            c.delete([b"gone-a"])  # meets the frozen Redis: times out, marks it failing
            assert tier.metric("kvtier_tier_healthy", tier="redis") == 0
            c.delete([b"gone-b"])  # skips the failing tier
            assert tier.metric("kvtier_tier_pending_deletes", tier="redis") == 2
        finally:
            redis_server.resume()
        assert _wait_for(lambda: tier.metric("kvtier_tier_healthy", tier="redis") == 1)
        # Replayed before Redis served again: neither value comes back from it.
        assert c.get([b"gone-a", b"gone-b"], stop_at_first_miss=False) == [None, None]
        assert c.lookup([b"gone-b"]) == 0
        (kept,) = c.get([b"kept"])
        assert kept is not None and bytes(kept) == values[b"kept"]
    assert int(redis_server.cli("DBSIZE")) == 1
    assert tier.metric("kvtier_tier_pending_deletes", tier="redis") == 0
    assert tier.metric("kvtier_tier_deletes_dropped_total", tier="redis") == 0


def _load(target: str, stop: threading.Event, errors: list[BaseException], n: int) -> None:
    """Puts and reads back values until ``stop``; every call must succeed."""
    try:
        with TierClient(target, timeout_s=5) as c:
            i = 0
            while not stop.is_set():
                key, data = b"load%d-%d" % (n, i), os.urandom(50_000)
                assert c.put([(key, data)]) == 1
                (got,) = c.get([key])
                assert got is not None and bytes(got) == data
                assert c.get([b"absent%d-%d" % (n, i)]) == [None]
                i += 1
    except BaseException as exc:
        errors.append(exc)


def _puts(tier: TierProcess) -> float:
    """Puts answered OK, over gRPC and the data port."""
    ok = [tier.metric("kvtier_server_requests_total", op=op, code="OK") for op in ("Put", "DataPut")]
    return sum(ok)


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_redis_killed_or_frozen_under_concurrent_load_fails_no_call_and_the_tier_recovers(
    start_tier: Callable[..., TierProcess], redis_server: RedisServer, fault: str
) -> None:
    tier = start_tier(
        "--redis-url", redis_server.url, "--disk-bytes", "0", "--tier-timeout", "500ms", "--redis-timeout", "300ms"
    )
    stop, errors = threading.Event(), list[BaseException]()
    threads = [threading.Thread(target=_load, args=(tier.target, stop, errors, n)) for n in range(3)]
    for t in threads:
        t.start()
    try:
        assert _wait_for(lambda: _puts(tier) >= 30)
        redis_server.kill() if fault == "SIGKILL" else redis_server.pause()
        assert _wait_for(lambda: tier.metric("kvtier_tier_healthy", tier="redis") == 0)
        puts = _puts(tier)
        assert _wait_for(lambda: _puts(tier) >= puts + 30)
        redis_server.restart() if fault == "SIGKILL" else redis_server.resume()
        assert _wait_for(lambda: tier.metric("kvtier_tier_healthy", tier="redis") == 1)
        redis_server.cli("FLUSHALL")
        assert _wait_for(lambda: int(redis_server.cli("DBSIZE")) >= 1), "writes reach Redis again"
    finally:
        if fault == "SIGSTOP":
            redis_server.resume()
        stop.set()
        for t in threads:
            t.join(30)
    assert errors == []
    assert tier.log.read_text().count("redis tier failing") == 1


def test_a_corrupted_value_in_redis_is_never_served_and_is_counted(
    start_tier: Callable[..., TierProcess], redis_server: RedisServer
) -> None:
    tier = start_tier("--redis-url", redis_server.url, "--disk-bytes", "0", "--write-policy", "write-through")
    with TierClient(tier.target) as c:
        c.put([(b"victim", os.urandom(10_000))])
    tier.restart()  # empty RAM: the next read goes to Redis
    r = redis.Redis.from_url(redis_server.url)
    (name,) = r.keys("*")
    r.setrange(name, 5000, b"garbage")
    r.close()
    with TierClient(tier.target) as c:
        assert c.get([b"victim"]) == [None]
        assert c.lookup([b"victim"]) == 0
    assert tier.metric("kvtier_tier_verification_failures_total", tier="redis") == 1


def _round_trip_through_redis_only(start_tier: Callable[..., TierProcess], *flags: str) -> None:
    writer = start_tier(*flags, "--disk-bytes", "0", "--write-policy", "write-through")
    reader = start_tier(*flags, "--disk-bytes", "0")
    data = os.urandom(100_000)
    with TierClient(writer.target) as c:
        assert c.put([(b"via-redis", data)]) == 1
    with TierClient(reader.target) as c:
        (got,) = c.get([b"via-redis"])
    assert got is not None and bytes(got) == data
    assert reader.metric("kvtier_tier_hits_total", tier="redis") == 1


def test_the_server_reaches_redis_over_a_unix_socket(
    start_tier: Callable[..., TierProcess], redis_unix: RedisServer
) -> None:
    _round_trip_through_redis_only(start_tier, "--redis-url", redis_unix.unix_url)


def test_the_server_reaches_redis_over_tls(
    start_tier: Callable[..., TierProcess], redis_tls: RedisServer, tls_files: TlsFiles
) -> None:
    _round_trip_through_redis_only(
        start_tier, "--redis-url", redis_tls.tls_url, "--redis-tls-ca-file", str(tls_files.ca)
    )


def test_the_server_uses_a_redis_cluster(
    start_tier: Callable[..., TierProcess], redis_cluster: RedisClusterProcs
) -> None:
    _round_trip_through_redis_only(start_tier, "--redis-url", redis_cluster.url)


def test_a_missing_tls_ca_file_stops_the_server_with_a_clear_message(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.cacheserver", "--redis-url", "rediss://127.0.0.1:1",
         "--redis-tls-ca-file", str(tmp_path / "nope.crt")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 2
    assert "--redis-tls-ca-file (env KVTIER_REDIS_TLS_CA_FILE)" in r.stderr and "not a readable file" in r.stderr
