"""Calls that race on real tier processes (issue 21, items 5-7).

A Delete wins over a write-behind copy already in flight (Redis, disk), a Get
during a disk write keeps the key indexed, and Stats answers for the caller's
tenant only.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.connector.client import TierClient
from kvtier.testing.redisprocs import RedisServer
from kvtier.testing.tierproc import TierProcess

MIB = 1 << 20
TOKEN_A = "a" * 24 + "-tenant-a-token"
TOKEN_B = "b" * 24 + "-tenant-b-token"


def drained(tier: TierProcess, timeout_s: float = 30.0) -> None:
    """Waits until no write-behind copy is waiting (and the last one taken had time to land)."""
    deadline = time.monotonic() + timeout_s
    while tier.metric("kvtier_write_behind_queue_depth") > 0:
        assert time.monotonic() < deadline, "write-behind copies still waiting"
        time.sleep(0.1)
    time.sleep(1.0)


# -- item 5: Delete against a write-behind copy in flight ----------------------------------


def test_a_delete_wins_over_a_write_behind_copy_to_redis_already_in_flight(
    start_tier: Callable[..., TierProcess], redis_server: RedisServer
) -> None:
    tier = start_tier("--redis-url", redis_server.url, "--disk-bytes", "0", "--redis-timeout", "5s",
                      "--tier-timeout", "10s")  # fmt: skip
    keys = [b"erase%d" % i for i in range(6)]
    with TierClient(tier.target, timeout_s=30) as c:
        for key in keys:
            c.put([(key, os.urandom(24 * MIB))])  # its copy to Redis starts at once ...
            assert c.delete([key]) == 1  # ... and is still being sent when the Delete comes
        drained(tier)
        assert c.get(keys, stop_at_first_miss=False) == [None] * len(keys)
        assert c.lookup(keys[:1]) == 0
    assert int(redis_server.cli("DBSIZE")) == 0, "a deleted value landed in Redis after its Delete"


def test_a_delete_wins_over_a_write_behind_copy_to_disk_already_in_flight(
    start_tier: Callable[..., TierProcess],
) -> None:
    tier = start_tier("--disk-fsync", "true", "--tier-timeout", "10s")
    keys = [b"erase%d" % i for i in range(6)]
    with TierClient(tier.target, timeout_s=30) as c:
        for key in keys:
            c.put([(key, os.urandom(24 * MIB))])
            assert c.delete([key]) == 1
        drained(tier)
    files = [p for p in (tier.directory / "disk" / "v1").rglob("*") if p.is_file()]
    assert files == [], "a deleted value's file landed on disk after its Delete"
    tier.restart()  # the index is rebuilt from the files: nothing deleted comes back
    with TierClient(tier.target, timeout_s=30) as c:
        assert c.get(keys, stop_at_first_miss=False) == [None] * len(keys)


# -- item 6: a Get during a disk write ------------------------------------------------------


def test_gets_during_disk_writes_never_drop_a_key_from_the_disk_index(
    start_tier: Callable[..., TierProcess],
) -> None:
    # Values larger than the RAM tier live on disk only, so every Get reads the disk tier.
    tier = start_tier("--ram-bytes", "1MiB", "--disk-fsync", "true", "--tier-timeout", "10s")
    keys = [b"v%d" % i for i in range(24)]
    current: list[bytes] = []
    stop = threading.Event()

    def read() -> None:
        with TierClient(tier.target, timeout_s=30) as r:
            while not stop.is_set():
                if current:
                    r.get([current[-1]])

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        with TierClient(tier.target, timeout_s=30) as c:
            for key in keys:
                current.append(key)
                assert c.put([(key, os.urandom(2 * MIB))]) == 1
                time.sleep(0.05)
    finally:
        stop.set()
        for t in readers:
            t.join(30)
    drained(tier)
    with TierClient(tier.target, timeout_s=30) as c:
        missing = [k for k in keys if c.lookup([k]) == 0]
    files = [p for p in (tier.directory / "disk" / "v1").rglob("*") if p.is_file()]
    assert missing == [], f"{len(missing)} of {len(keys)} keys dropped from the disk index"
    assert tier.metric("kvtier_tier_entries", tier="disk") == len(files) == len(keys)


# -- item 7: Stats per tenant -----------------------------------------------------------------


def test_stats_counts_only_the_callers_tenant(start_tier: Callable[..., TierProcess], tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "team-a").write_text(TOKEN_A)
    (tokens / "team-b").write_text(TOKEN_B)
    tier = start_tier("--auth-tokens", str(tokens))
    with (
        TierClient(tier.target, token=TOKEN_A, timeout_s=30) as a,
        TierClient(tier.target, token=TOKEN_B, timeout_s=30) as b,
    ):
        a.put([(b"a%d" % i, os.urandom(100_000)) for i in range(3)])
        a.get([b"a0", b"a1", b"a2", b"nothing"], stop_at_first_miss=False)
        drained(tier)
        seen_by_b = {t.name: t for t in b.stats().tiers}
        seen_by_a = {t.name: t for t in a.stats().tiers}
    for name in ("ram", "disk"):
        t = seen_by_b[name]
        assert (t.entries, t.used_bytes, t.hits, t.misses, t.evictions) == (0, 0, 0, 0, 0), name
        assert seen_by_a[name].entries == 3
    assert seen_by_a["ram"].hits == 3 and seen_by_a["ram"].misses == 1
    assert 300_000 <= seen_by_a["ram"].used_bytes < 400_000
