"""The same-node transport on real tier processes: its Unix socket, shared segments and leases.

``TierClient`` with ``local_socket`` for what clients do, ``kvtier.testing.localraw`` for
what they must not be able to do (hold a lease and stop, die mid-copy, write into the
tier's memory, send garbage).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.connector.client import TierClient
from kvtier.connector.errors import TierRejected, TierUnavailable
from kvtier.proto import localwire as lw
from kvtier.proto.localwire import Op, Place, Status
from kvtier.testing.localraw import RawLocal
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.waits import wait_for

TOKEN_A = "a" * 24 + "-tenant-a-token"
TOKEN_B = "b" * 24 + "-tenant-b-token"
MIB = 1 << 20


def value(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that say which value they are in every 16-byte block."""
    return (seed.to_bytes(4, "little") + os.urandom(12)) * (n // 16) + b"x" * (n % 16)


def as_bytes(values: list[bytes | memoryview | None]) -> list[bytes | None]:
    return [None if v is None else bytes(v) for v in values]


@pytest.fixture
def local_tier(start_tier: Callable[..., TierProcess]) -> TierProcess:
    return start_tier("--max-keys", "64", "--max-value-bytes", "80MiB", local_socket=True, data_port=True)


@pytest.fixture
def client(local_tier: TierProcess) -> Iterator[TierClient]:
    with TierClient(local_tier.target, local_socket=local_tier.local_socket, timeout_s=30, data_path="local") as c:
        yield c


@pytest.fixture
def tokens_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tokens"
    d.mkdir()
    (d / "team-a").write_text(TOKEN_A)
    (d / "team-b").write_text(TOKEN_B)
    return d


# -- round trips -----------------------------------------------------------------------


def test_values_of_every_size_come_back_byte_for_byte(client: TierClient) -> None:
    sizes = [1, 1000, (64 << 10) - 1, 64 << 10, MIB + 3, 16 * MIB + 5]
    items = [(b"v%d" % n, value(n, i)) for i, n in enumerate(sizes)]
    assert client.put(items[:3]) == 3
    assert client.put([(k, [v[:5], v[5:]]) for k, v in items[3:]]) == 3  # values given in two parts
    assert as_bytes(client.get([k for k, _ in items])) == [v for _, v in items]
    assert client.transport == "local"


def test_a_64_mib_value_round_trips_whole(client: TierClient) -> None:
    big = value(64 * MIB | 12345)
    assert client.put([(b"big", big)]) == 1
    (got,) = client.get([b"big"])
    assert got is not None and bytes(got) == big


def test_get_stops_at_the_first_miss_only_when_asked(client: TierClient) -> None:
    client.put([(b"a", b"1"), (b"c", value(MIB))])
    assert as_bytes(client.get([b"a", b"b", b"c"])) == [b"1", None]
    assert as_bytes(client.get([b"a", b"b", b"c"], stop_at_first_miss=False))[:2] == [b"1", None]


def test_lookup_delete_and_stats_answer_over_the_socket(local_tier: TierProcess, client: TierClient) -> None:
    client.put([(b"a", b"1"), (b"b", value(MIB))])
    assert client.lookup([b"a", b"b", b"c", b"a"]) == 2
    assert client.delete([b"a", b"zz"]) == 1
    assert client.lookup([b"a"]) == 0
    stats = client.stats()
    assert stats.tenant == "default" and [t.name for t in stats.tiers] == ["ram", "disk"]
    for op in ("LocalLookup", "LocalDelete", "LocalStats"):  # (counted once the reply is sent)
        assert wait_for(lambda op=op: local_tier.metric("kvtier_server_requests_total", op=op, code="OK") >= 1)
    assert local_tier.metric("kvtier_server_requests_total", op="Lookup", code="OK") == 0  # never gRPC


def test_a_large_value_is_answered_with_where_it_lies_not_with_its_bytes(
    local_tier: TierProcess, client: TierClient
) -> None:
    big, small = value(8 * MIB, 1), b"tiny"
    client.put([(b"big", big), (b"small", small)])
    with RawLocal(local_tier.local_socket, "") as raw:
        reply, (e_big, e_small) = raw.get([b"big", b"small"])
        assert reply.status == Status.OK and reply.extra == 1  # the segment's fd rode on the reply
        assert e_big.place == Place.SHARED and e_big.length == len(big)
        assert e_big.checksum == lw.checksum(big)
        assert raw.read(e_big) == big
        assert e_small.place == Place.INLINE and e_small.inline == small
        raw.release()
        reply, _ = raw.get([b"big"])
        assert reply.extra == 0  # a connection is handed a segment once
        raw.release()


def test_values_are_the_same_entries_over_every_transport(local_tier: TierProcess) -> None:
    with (
        TierClient(local_tier.target, local_socket=local_tier.local_socket, data_path="local") as local,
        TierClient(local_tier.target, data_path="data") as data,
        TierClient(local_tier.target, data_path="grpc") as grpc_,
    ):
        local.put([(b"via-local", value(2 * MIB, 1))])
        data.put([(b"via-data", value(2 * MIB, 2))])
        grpc_.put([(b"via-grpc", value(3 * MIB, 3))])  # several frames: reassembled into a segment
        keys = [b"via-local", b"via-data", b"via-grpc"]
        assert as_bytes(local.get(keys)) == as_bytes(data.get(keys)) == as_bytes(grpc_.get(keys))
        assert local_tier.metric("kvtier_server_requests_total", op="LocalGet", code="OK") == 1


def test_metrics_count_local_requests_and_value_bytes(local_tier: TierProcess, client: TierClient) -> None:
    client.put([(b"m", b"x" * 1000), (b"n", value(MIB))])  # a small value: no room is reserved
    client.put([(b"o", value(MIB))])
    client.get([b"m", b"n", b"o", b"none"], stop_at_first_miss=False)
    # The first Put reserved, got nothing (values under 64 KiB stay on the tier's heap) and
    # went through a staging segment; the second reserved room and wrote into it.
    assert local_tier.metric("kvtier_server_requests_total", op="LocalReserve", code="OK") == 2
    assert local_tier.metric("kvtier_server_requests_total", op="LocalPut", code="OK") >= 2
    # A request is counted once its reply is sent, and a lease ends when the client's
    # Release (which has no reply) arrives: both can come just after the client goes on.
    assert wait_for(lambda: local_tier.metric("kvtier_server_requests_total", op="LocalGet", code="OK") == 1)
    assert local_tier.metric("kvtier_server_requests_total", op="LocalStage", code="OK") == 1
    assert local_tier.metric("kvtier_server_received_bytes_total") == 1000 + 2 * MIB
    assert local_tier.metric("kvtier_server_sent_bytes_total") == 1000 + 2 * MIB
    assert local_tier.metric("kvtier_server_get_keys_total", result="miss") == 1
    assert local_tier.metric("kvtier_local_connections") == 1
    assert wait_for(lambda: local_tier.metric("kvtier_local_leased_bytes") == 0)  # released once copied
    assert local_tier.metric("kvtier_ram_shared_used_bytes") >= MIB


def test_the_socket_is_group_writable_and_only_that(local_tier: TierProcess) -> None:
    mode = os.stat(local_tier.local_socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660


# -- concurrency: replace, evict, delete while clients read --------------------------------


def test_readers_never_see_a_value_half_old_half_new_while_writers_replace_and_evict(
    start_tier: Callable[..., TierProcess],
) -> None:
    tier = start_tier("--ram-bytes", "48MiB", "--disk-bytes", "0", "--incoming-bytes", "64MiB", "--max-value-bytes", "8MiB",
        local_socket=True,
)
    keys = [b"k%d" % i for i in range(6)]
    size = 3 * MIB
    stop = threading.Event()
    errors: list[str] = []
    reads = [0]

    def writer(n: int) -> None:
        with TierClient(tier.target, local_socket=tier.local_socket, timeout_s=30, data_path="local") as c:
            version = 0
            while not stop.is_set():
                version += 1
                key = keys[version % len(keys)]
                c.put([(key, bytes([n * 50 + version % 50]) * size)])  # one byte value, repeated
                c.put([(b"filler-%d-%d" % (n, version), os.urandom(size))])  # pushes others out
                if version % 7 == 0:
                    c.delete([key])

    def reader() -> None:
        with TierClient(tier.target, local_socket=tier.local_socket, timeout_s=30, data_path="local") as c:
            while not stop.is_set():
                values = c.get(keys, stop_at_first_miss=False)
                for got in values:
                    if got is None:
                        continue
                    b = bytes(got)
                    if len(b) != size or b.count(b[:1]) != size:
                        errors.append(f"a value of {len(b)} bytes mixes {len(set(b))} versions")
                    reads[0] += 1
                c.recycle(values)  # later Gets copy into these buffers again

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(8)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert reads[0] > 0
    assert tier.metric("kvtier_tier_evictions_total", tier="ram") > 0
    assert tier.metric("kvtier_server_requests_total", op="LocalGet", code="INTERNAL") == 0


def test_a_leased_value_keeps_its_bytes_while_it_is_replaced_deleted_and_its_memory_wanted(
    start_tier: Callable[..., TierProcess],
) -> None:
    tier = start_tier("--ram-bytes", "32MiB", "--disk-bytes", "0", "--incoming-bytes", "32MiB", "--max-value-bytes", "8MiB",
        local_socket=True,
)
    old = value(4 * MIB, 1)
    with TierClient(tier.target, local_socket=tier.local_socket, data_path="local") as c:
        c.put([(b"k", old)])
        with RawLocal(tier.local_socket, "") as raw:
            _, (entry,) = raw.get([b"k"])
            assert entry.place == Place.SHARED
            c.put([(b"k", value(4 * MIB, 2))])  # replaced
            c.delete([b"k"])  # and deleted
            news = [value(4 * MIB, 10 + i) for i in range(20)]
            for i, new in enumerate(news):  # and its memory wanted by 80 MiB of new values
                c.put([(b"new%d" % i, new)])
            assert raw.read(entry) == old  # the lease kept it whole
            assert tier.metric("kvtier_local_leased_bytes") == 4 * MIB
            raw.release()
            assert wait_for(lambda: tier.metric("kvtier_local_leased_bytes") == 0)
        assert as_bytes(c.get([b"new19"])) == [news[19]]
        assert tier.metric("kvtier_tier_evictions_total", tier="ram") > 0


def test_a_client_that_holds_a_lease_past_the_data_timeout_is_closed_before_its_lease_goes(
    start_tier: Callable[..., TierProcess],
) -> None:
    tier = start_tier("--data-timeout", "1s", local_socket=True)
    with TierClient(tier.target, local_socket=tier.local_socket, data_path="local") as c:
        c.put([(b"k", value(2 * MIB))])
    with RawLocal(tier.local_socket, "") as raw:
        raw.get([b"k"])  # and never releases
        assert wait_for(raw.closed_by_tier, 10)
    assert wait_for(lambda: tier.metric("kvtier_local_leased_bytes") == 0)
    assert tier.metric("kvtier_local_lease_timeouts_total") == 1


_HOLD_A_LEASE = """
import sys, time
from kvtier.testing.localraw import RawLocal
raw = RawLocal(sys.argv[1], "")
_, entries = raw.get([b"k"])
raw.read(entries[0])[:1]  # mid-copy
raw.stage(8 << 20)  # and a staging segment of its own
_, (place,) = raw.reserve([8 << 20])  # and a reservation, half written
raw.write(place, b"x" * (4 << 20))
print("leased", flush=True)
time.sleep(600)
"""


def test_a_client_killed_mid_copy_leaks_no_lease_no_staging_and_no_memory(local_tier: TierProcess) -> None:
    new = value(8 * MIB, 1)
    with TierClient(local_tier.target, local_socket=local_tier.local_socket, data_path="local") as c:
        c.put([(b"k", value(8 * MIB))])
        used_before = local_tier.metric("kvtier_ram_shared_used_bytes")
        incoming_before = local_tier.metric("kvtier_server_incoming_bytes")  # our own staging
        child = subprocess.Popen(
            [sys.executable, "-c", _HOLD_A_LEASE, local_tier.local_socket], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "leased"
            c.put([(b"k", new)])  # the leased value is replaced: its memory is still held
            assert local_tier.metric("kvtier_local_leased_bytes") == 8 * MIB
            # its staging segment and its reservation; the replaced value and the reservation
            assert local_tier.metric("kvtier_server_incoming_bytes") == incoming_before + 16 * MIB
            assert local_tier.metric("kvtier_ram_shared_used_bytes") == used_before + 16 * MIB
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        assert wait_for(lambda: local_tier.metric("kvtier_local_connections") == 1)  # only ours
        assert local_tier.metric("kvtier_local_leased_bytes") == 0
        assert local_tier.metric("kvtier_server_incoming_bytes") == incoming_before
        assert local_tier.metric("kvtier_ram_shared_used_bytes") == used_before  # the old extent is free
        assert as_bytes(c.get([b"k"])) == [new]


# -- the tier's memory is the tier's --------------------------------------------------------


def test_a_client_cannot_write_resize_or_punch_the_tier_segments_even_through_proc(
    local_tier: TierProcess, client: TierClient
) -> None:
    """The tier's own segments (values that came over TCP, or that no tenant reserved)."""
    import mmap

    data = value(2 * MIB)
    with TierClient(local_tier.target, data_path="data") as tcp:
        tcp.put([(b"k", data)])
    with RawLocal(local_tier.local_socket, "") as raw:
        _, (entry,) = raw.get([b"k"])
        fd = raw.segment_fds[entry.segment]
        with pytest.raises(OSError):
            os.pwrite(fd, b"x", entry.offset)  # read-only descriptor
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # opened again, read-write
        try:
            for attempt in (
                lambda: os.pwrite(rw, b"x", entry.offset),
                lambda: mmap.mmap(rw, entry.offset + entry.length),
                lambda: os.ftruncate(rw, 0),
                lambda: os.ftruncate(rw, 1 << 40),
            ):
                with pytest.raises(PermissionError):
                    attempt()
        finally:
            os.close(rw)
        assert raw.read(entry) == data
        raw.release()
    assert as_bytes(client.get([b"k"])) == [data]


def test_a_client_that_shrinks_its_staging_segment_cannot_crash_the_tier(local_tier: TierProcess, client: TierClient) -> None:
    with RawLocal(local_tier.local_socket, "") as raw:
        reply, fd = raw.stage(4 * MIB)
        assert reply.status == Status.OK and fd is not None
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        os.close(fd)
    client.put([(b"still", b"up")])
    assert as_bytes(client.get([b"still"])) == [b"up"]


def test_a_connection_that_staged_and_closed_leaves_the_next_connection_alone(
    local_tier: TierProcess,
) -> None:
    """The tier's copy of a staging descriptor is closed once: the number may belong to the
    next connection's socket by the time the staging connection ends."""
    first = RawLocal(local_tier.local_socket, "")
    _, fd = first.stage(MIB)
    assert fd is not None
    os.close(fd)
    with RawLocal(local_tier.local_socket, "") as second:  # likely given the freed number
        first.close()
        time.sleep(0.2)
        second.request(Op.LOOKUP, lw.key_table([b"k"]), count=1)
        assert second.reply().status == Status.OK
    assert local_tier.proc is not None and local_tier.proc.poll() is None


def test_a_put_whose_staged_bytes_do_not_match_its_checksum_stores_nothing_of_it(
    local_tier: TierProcess, client: TierClient
) -> None:
    import mmap

    good, bad = value(MIB, 1), value(MIB, 2)
    with RawLocal(local_tier.local_socket, "") as raw:
        _, fd = raw.stage(2 * MIB)
        assert fd is not None
        staging = mmap.mmap(fd, 2 * MIB)
        staging[: MIB] = good
        staging[MIB :] = bad
        reply = raw.put([(b"good", 0, MIB, lw.checksum(good)), (b"bad", MIB, MIB, lw.checksum(good))])
        assert reply.status == Status.INVALID_ARGUMENT and reply.count == 1
        assert "LocalPut.values[1].checksum" in reply.text
        reply = raw.put([(b"outside", MIB, 2 * MIB, 0)])
        assert reply.status == Status.INVALID_ARGUMENT and "outside the staging segment" in reply.text
        staging.close()
        os.close(fd)
    assert as_bytes(client.get([b"good", b"bad", b"outside"], stop_at_first_miss=False)) == [good, None, None]


@pytest.mark.parametrize("where", ["ram", "disk"])
def test_staged_bytes_changed_while_the_tier_stores_them_are_refused_never_stored_torn(
    start_tier: Callable[..., TierProcess], where: str
) -> None:
    """The client keeps writing its staging segment while the tier stores a value from it:
    into RAM the tier copies it first; to a disk-only tier, written through, the tier writes
    the record file straight from the segment (``DiskTier.put_checked``). Either way the
    value is stored as staged (the checksum matches) or refused, never a mix."""
    import mmap
    import threading

    size = 16 * MIB
    flags = ("--ram-bytes", "1", "--write-policy", "write-through") if where == "disk" else ()
    tier = start_tier(*flags, "--max-value-bytes", "80MiB", local_socket=True)
    staged = value(size, 7)
    outcomes = []
    with RawLocal(tier.local_socket, "") as raw:
        _, fd = raw.stage(size)
        assert fd is not None
        staging = mmap.mmap(fd, size)
        for attempt in range(6):
            staging[:] = staged
            stop = threading.Event()

            def flip(stop: threading.Event = stop) -> None:
                while not stop.is_set():  # bytes across the value change and change back
                    for pos in range(0, size, 1 << 20):
                        staging[pos] ^= 0xFF
            flipper = threading.Thread(target=flip) if attempt else None  # the first: untouched
            if flipper is not None:
                flipper.start()
            try:
                reply = raw.put([(b"v%d" % attempt, 0, size, lw.checksum(staged))])
            finally:
                stop.set()
                if flipper is not None:
                    flipper.join()
            assert reply.status in (Status.OK, Status.INVALID_ARGUMENT), reply.text
            outcomes.append(reply.status == Status.OK)
        staging.close()
        os.close(fd)
    with TierClient(tier.target, local_socket=tier.local_socket, data_path="local") as c:
        got = as_bytes(c.get([b"v%d" % i for i in range(6)], stop_at_first_miss=False))
    assert got == [staged if ok else None for ok in outcomes]
    assert outcomes[0] and not all(outcomes[1:]), outcomes  # the untouched one stored; flips refused
    if where == "disk":
        assert tier.metric("kvtier_tier_entries", tier="ram") == 0
        assert len(record_files(tier)) == sum(outcomes)


# -- one copy: values written straight into memory reserved for them ------------------------------


def test_a_put_writes_each_value_once_into_memory_the_tier_reserved_for_it(
    local_tier: TierProcess, client: TierClient
) -> None:
    values = [(b"r%d" % i, value(4 * MIB, i)) for i in range(6)]  # 24 MiB: two PUT requests
    assert client.put(values) == 6
    assert local_tier.metric("kvtier_server_requests_total", op="LocalReserve", code="OK") == 1
    assert wait_for(lambda: local_tier.metric("kvtier_server_requests_total", op="LocalPut", code="OK") == 2)
    assert local_tier.metric("kvtier_server_requests_total", op="LocalStage", code="OK") == 0
    assert local_tier.metric("kvtier_server_incoming_bytes") == 0  # every reservation stored
    with RawLocal(local_tier.local_socket, "") as raw:
        reply, entries = raw.get([k for k, _ in values])
        assert reply.status == Status.OK
        for entry, (_, v) in zip(entries, values, strict=True):
            assert entry.place == Place.SHARED and entry.checksum == lw.checksum(v)
            assert raw.read(entry) == v
        raw.release()
    assert as_bytes(client.get([k for k, _ in values])) == [v for _, v in values]


def test_reserved_values_are_stored_once_and_bad_items_are_refused_naming_the_field(
    local_tier: TierProcess, client: TierClient
) -> None:
    good, other = value(MIB, 1), value(MIB, 2)
    with RawLocal(local_tier.local_socket, "") as raw:
        reply, places = raw.reserve([MIB, MIB, MIB])
        assert reply.status == Status.OK and reply.count == 3 and reply.extra == 1
        raw.write(places[0], good)
        raw.write(places[1], other)
        reply = raw.put([(b"good", 0, MIB, lw.checksum(good)), (b"again", 0, MIB, lw.checksum(good))], lw.FLAG_RESERVED)
        assert reply.status == Status.INVALID_ARGUMENT and reply.count == 1
        assert "LocalPut.values[1].length" in reply.text and "reservation 0, which is not held" in reply.text
        reply = raw.put([(b"short", 2, MIB - 1, 0)], lw.FLAG_RESERVED)
        assert reply.status == Status.INVALID_ARGUMENT and f"which is {MIB} bytes" in reply.text
        # The tier records the writer's checksum; a reader checks it and never returns the bytes.
        reply = raw.put([(b"liar", 1, MIB, lw.checksum(good))], lw.FLAG_RESERVED)
        assert reply.status == Status.OK and reply.count == 1
        reply, _ = raw.reserve([MIB, (80 << 20) + 1])
        assert reply.status == Status.RESOURCE_EXHAUSTED and "LocalReserve.sizes[1]" in reply.text
        assert "--max-value-bytes" in reply.text
    assert as_bytes(client.get([b"good", b"again", b"short"], stop_at_first_miss=False)) == [good, None, None]
    with pytest.raises(TierUnavailable, match="DATA_LOSS: value 0 of the Get failed its checksum"):
        client.get([b"liar"])
    assert wait_for(lambda: local_tier.metric("kvtier_server_incoming_bytes") == 0)


def test_a_reservations_pages_are_the_tiers_before_the_client_writes_them(local_tier: TierProcess) -> None:
    """Shared memory counts against the cgroup that first touches it: the tier faults a
    reservation's pages in itself, so the engine that writes them is not charged."""

    def tier_shmem() -> int:
        assert local_tier.proc is not None
        with open(f"/proc/{local_tier.proc.pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssShmem:"))

    before = tier_shmem()
    with RawLocal(local_tier.local_socket, "") as raw:
        reply, _ = raw.reserve([16 * MIB])
        assert reply.count == 1
        assert tier_shmem() >= before + 16 * MIB  # nothing written yet


def test_a_get_hands_a_client_only_segments_that_hold_its_own_tenants_values(
    start_tier: Callable[..., TierProcess], tokens_dir: Path
) -> None:
    """A client maps whole segments: values that came over TCP go to their tenant's own."""
    tier = start_tier("--auth-tokens", str(tokens_dir), local_socket=True, data_port=True)
    data = {TOKEN_A: value(2 * MIB, 1), TOKEN_B: value(2 * MIB, 2)}
    for token, v in data.items():
        with TierClient(tier.target, token=token, data_path="data") as tcp:
            tcp.put([(b"same-key", v)])
    seen = {}
    for token, v in data.items():
        with RawLocal(tier.local_socket, f"Bearer {token}") as raw:
            _, (entry,) = raw.get([b"same-key"])
            assert entry.place == Place.SHARED and raw.read(entry) == v
            assert set(raw.segments) == {entry.segment}
            seen[token] = entry.segment
            raw.release()
    assert seen[TOKEN_A] != seen[TOKEN_B]


def test_reservations_of_a_connection_the_tier_ended_stay_out_of_reuse_for_the_data_timeout(
    start_tier: Callable[..., TierProcess],
) -> None:
    """Its client may still be copying into them: another connection must not get them yet."""
    tier = start_tier("--data-timeout", "2s", local_socket=True)
    with RawLocal(tier.local_socket, "") as raw:
        reply, _ = raw.reserve([4 * MIB])
        assert reply.count == 1
        assert wait_for(raw.closed_by_tier, 10)  # idle past --data-timeout
        ended = time.monotonic()
        assert tier.metric("kvtier_ram_shared_used_bytes") == 4 * MIB
        assert wait_for(lambda: tier.metric("kvtier_ram_shared_used_bytes") == 0, 10)
        assert time.monotonic() - ended >= 1.0
    with RawLocal(tier.local_socket, "") as raw:  # a client that closes its own: freed at once
        reply, _ = raw.reserve([4 * MIB])
        assert reply.count == 1
    assert wait_for(lambda: tier.metric("kvtier_local_connections") == 0)
    assert tier.metric("kvtier_ram_shared_used_bytes") == 0


def test_a_tenants_reserved_memory_is_never_handed_to_another_tenant(
    start_tier: Callable[..., TierProcess], tokens_dir: Path
) -> None:
    tier = start_tier("--auth-tokens", str(tokens_dir), local_socket=True)
    data = value(2 * MIB, 5)
    with RawLocal(tier.local_socket, f"Bearer {TOKEN_A}") as a, RawLocal(tier.local_socket, f"Bearer {TOKEN_B}") as b:
        _, (place_a,) = a.reserve([2 * MIB])
        a.write(place_a, data)
        assert a.put([(b"p", 0, 2 * MIB, lw.checksum(data))], lw.FLAG_RESERVED).status == Status.OK
        reply, (place_b,) = b.reserve([2 * MIB])
        assert reply.extra == 1 and place_b[0] != place_a[0]  # a segment of B's own
        reply, (entry,) = b.get([b"p"])
        assert entry.place == Place.MISSING and reply.extra == 0
        assert set(b.segments) == {place_b[0]}
        with RawLocal(tier.local_socket, f"Bearer {TOKEN_A}") as a2:  # A's other connections share A's
            reply, (entry,) = a2.get([b"p"])
            assert entry.segment == place_a[0] and a2.read(entry) == data
            a2.release()
            b.hello(f"Bearer {TOKEN_A}")  # a connection that becomes A's loses what it reserved as B
            reply = b.put([(b"q", 0, 2 * MIB, 0)], lw.FLAG_RESERVED)
            assert reply.status == Status.INVALID_ARGUMENT and "not held" in reply.text


def test_a_wholly_free_tenant_segment_gives_its_room_to_another_tenant_and_no_room_means_staging(
    start_tier: Callable[..., TierProcess], tokens_dir: Path
) -> None:
    # --ram-bytes + --incoming-bytes = 24 MiB: room for one 24 MiB segment in all.
    tier = start_tier("--auth-tokens", str(tokens_dir), "--ram-bytes", "8MiB", "--incoming-bytes", "16MiB",
                      "--max-value-bytes", "4MiB", "--disk-bytes", "0", local_socket=True)  # fmt: skip
    data = value(4 * MIB, 6)
    with RawLocal(tier.local_socket, f"Bearer {TOKEN_A}") as a:
        reply, (place_a,) = a.reserve([4 * MIB])
        assert reply.count == 1
        a.write(place_a, data)
        with (
            RawLocal(tier.local_socket, f"Bearer {TOKEN_B}") as b,
            TierClient(tier.target, local_socket=tier.local_socket, token=TOKEN_B, data_path="local") as client_b,
        ):
            reply, _ = b.reserve([4 * MIB])
            assert reply.status == Status.OK and reply.count == 0  # A's segment is in use
            assert client_b.put([(b"k", data)]) == 1  # B's client stages it instead
            assert tier.metric("kvtier_server_requests_total", op="LocalStage", code="OK") == 1
            assert as_bytes(client_b.get([b"k"])) == [data]
        a.hello(f"Bearer {TOKEN_A}")  # drops A's reservation: its segment is wholly free
        segment_a, at = place_a
        with RawLocal(tier.local_socket, f"Bearer {TOKEN_B}") as b:
            reply, (place,) = b.reserve([4 * MIB])
            assert reply.count == 1 and reply.extra == 1 and place[0] != segment_a
            b.write(place, data)
            assert b.put([(b"k2", 0, 4 * MIB, lw.checksum(data))], lw.FLAG_RESERVED).status == Status.OK
            assert tier.metric("kvtier_ram_shared_bytes") == 24 * MIB  # A's segment was closed ...
            assert a.segments[segment_a][at : at + 4 * MIB] == bytes(4 * MIB)  # ... its pages released
    with TierClient(tier.target, local_socket=tier.local_socket, token=TOKEN_B, data_path="local") as client_b:
        assert as_bytes(client_b.get([b"k", b"k2"])) == [data, data]


# -- limits, bad input, auth, tenants ----------------------------------------------------------


def test_limits_are_refused_naming_the_field(client: TierClient) -> None:
    with pytest.raises(TierRejected, match=r"RESOURCE_EXHAUSTED: LocalGet.count: 65 keys .* \(--max-keys\)"):
        client.get([b"k%d" % i for i in range(65)])
    # A Put goes in windows of up to 64 MiB (one RESERVE each): the huge value is refused
    # by its own window's RESERVE, after the window before it was stored.
    with pytest.raises(TierRejected, match=r"RESOURCE_EXHAUSTED: LocalReserve.sizes\[0\]: .* \(--max-value-bytes\)"):
        client.put([(b"small", b"s"), (b"huge", bytes((80 << 20) + 1))])
    assert as_bytes(client.get([b"small"])) == [b"s"]
    with pytest.raises(TierRejected, match=r"INVALID_ARGUMENT: LocalPut.keys\[0\]: key of 257 bytes"):
        client.put([(b"k" * 257, b"v")])
    with pytest.raises(TierRejected, match=r"INVALID_ARGUMENT: LocalLookup.keys\[1\]: key of 0 bytes"):
        client.lookup([b"a", b""])
    assert client.put([(b"after", b"ok")]) == 1
    assert client.get([b"huge"]) == [None]


def test_garbage_gets_an_error_reply_and_the_tier_keeps_serving(local_tier: TierProcess, client: TierClient) -> None:
    with RawLocal(local_tier.local_socket) as raw:
        raw.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = raw.reply()
        assert reply.status == Status.INVALID_ARGUMENT and "bad magic" in reply.text
        assert wait_for(raw.closed_by_tier, 5)
    with RawLocal(local_tier.local_socket) as raw:
        raw.send(lw.REQUEST.pack(lw.MAGIC, lw.VERSION, 99, 0, 0, 0))
        reply = raw.reply()
        assert reply.status == Status.INVALID_ARGUMENT and "unknown op 99" in reply.text
    with RawLocal(local_tier.local_socket) as raw:
        raw.request(Op.GET, b"\x02\x00ab", count=3)
        reply = raw.reply()
        assert reply.status == Status.INVALID_ARGUMENT and "LocalGet.table: ends inside key 1 of 3" in reply.text
        raw.request(Op.STAGE, b"\x00" * 8)
        assert raw.reply().status == Status.INVALID_ARGUMENT
        raw.request(Op.LOOKUP, lw.key_table([b"still"]), count=1)
        assert raw.reply().status == Status.OK  # the connection stayed usable
    client.put([(b"still", b"up")])
    assert as_bytes(client.get([b"still"])) == [b"up"]
    assert local_tier.metric("kvtier_server_requests_total", op="LocalInvalid", code="INVALID_ARGUMENT") == 2


def test_tenants_are_isolated_and_a_missing_or_unknown_token_is_unauthenticated(
    start_tier: Callable[..., TierProcess], tokens_dir: Path
) -> None:
    tier = start_tier("--auth-tokens", str(tokens_dir), local_socket=True)
    path = tier.local_socket
    with (
        TierClient(tier.target, local_socket=path, token=TOKEN_A, data_path="local") as a,
        TierClient(tier.target, local_socket=path, token=TOKEN_B, data_path="local") as b,
    ):
        a.put([(b"prefix", value(MIB))])
        assert a.lookup([b"prefix"]) == 1 and b.lookup([b"prefix"]) == 0
        assert b.get([b"prefix"]) == [None]
        assert a.stats().tenant == "team-a" and b.stats().tenant == "team-b"
    for token in (None, "x" * 40):
        with (
            TierClient(tier.target, local_socket=path, token=token, data_path="local") as no,
            pytest.raises(TierRejected, match="UNAUTHENTICATED"),
        ):
            no.get([b"prefix"])
    with RawLocal(path) as raw:  # no HELLO: no tenant
        raw.request(Op.GET, lw.key_table([b"k"]), count=1)
        reply = raw.reply()
        assert reply.status == Status.UNAUTHENTICATED and "missing 'authorization" in reply.text
        assert wait_for(raw.closed_by_tier, 5)


def test_a_token_revoked_while_connected_stops_working_at_once(
    start_tier: Callable[..., TierProcess], tokens_dir: Path
) -> None:
    tier = start_tier("--auth-tokens", str(tokens_dir), local_socket=True)
    with TierClient(tier.target, local_socket=tier.local_socket, token=TOKEN_B, data_path="local") as b:
        b.put([(b"k", b"v")])
        (tokens_dir / "team-b").unlink()
        assert wait_for(lambda: _refused(b), 15)


def _refused(client: TierClient) -> bool:
    try:
        client.lookup([b"k"])
    except TierRejected as exc:
        return "UNAUTHENTICATED" in str(exc)
    return False


# -- the socket file and the tier's lifetime -----------------------------------------------------


def test_a_tier_restarted_under_a_client_is_used_again_through_its_new_socket(local_tier: TierProcess) -> None:
    data = value(2 * MIB)
    with TierClient(local_tier.target, local_socket=local_tier.local_socket, timeout_s=10) as c:
        c.put([(b"k", data)])
        # On disk: indexed, and its write-behind put (which returns once the file is in
        # place) done; the index counts a key from the start of its write.
        assert wait_for(
            lambda: local_tier.metric("kvtier_tier_entries", tier="disk") == 1
            and local_tier.metric("kvtier_write_behind_queue_depth") == 0
        )
        local_tier.restart()  # SIGKILL: the old socket file stays behind, the new tier replaces it
        got: list[bytes | None] = []

        def answered() -> bool:
            try:
                got[:] = as_bytes(c.get([b"k"]))
            except TierUnavailable:
                return False
            return True

        assert wait_for(answered, 20)
        assert got == [data]  # the disk tier kept it; served again
        assert c.transport == "local"
    assert "Traceback" not in local_tier.log.read_text()


def test_a_socket_path_held_by_a_live_tier_or_another_file_is_refused(
    local_tier: TierProcess, start_tier: Callable[..., TierProcess], tmp_path: Path
) -> None:
    with pytest.raises(RuntimeError, match=r"another process .* listens on"):
        start_tier("--local-socket", local_tier.local_socket)
    other = Path(local_tier.local_socket).with_name("plain-file")
    other.write_text("not a socket")
    with pytest.raises(RuntimeError, match="exists and is not a socket"):
        start_tier("--local-socket", str(other))
    with pytest.raises(RuntimeError, match=r"--local-socket .*\(107 bytes\)"):
        start_tier("--local-socket", "/tmp/" + "x" * 120)


def test_a_stopped_tier_removes_its_socket_file(start_tier: Callable[..., TierProcess]) -> None:
    tier = start_tier(local_socket=True)
    assert os.path.exists(tier.local_socket)
    assert tier.terminate() == 0
    assert not os.path.exists(tier.local_socket)


# -- values held only on disk: read by the client from their record files -------------


@pytest.fixture
def disk_tier(start_tier: Callable[..., TierProcess]) -> TierProcess:
    """Every value on disk only: a RAM tier of 1 byte, and Puts written through."""
    return start_tier(
        "--ram-bytes", "1", "--write-policy", "write-through", "--max-keys", "512",
        "--max-value-bytes", "80MiB", local_socket=True, data_port=True,
    )  # fmt: skip


def record_files(tier: TierProcess) -> list[Path]:
    return sorted(p for p in (tier.disk_view / "v1").rglob("*") if p.is_file())


def test_a_value_held_only_on_disk_comes_back_from_its_record_file(disk_tier: TierProcess) -> None:
    sizes = [2, 1000, 64 << 10, 5 * MIB + 3, 64 * MIB | 12345]  # more than the RAM tier holds
    items = [(b"d%d" % n, value(n, i)) for i, n in enumerate(sizes)]
    with TierClient(disk_tier.target, local_socket=disk_tier.local_socket, data_path="local") as c:
        assert c.put(items) == len(items)
        assert as_bytes(c.get([k for k, _ in items] + [b"absent"])) == [v for _, v in items] + [None]
    assert len(record_files(disk_tier)) == len(items)
    assert disk_tier.metric("kvtier_tier_hits_total", tier="disk") == len(items)
    # Values only the disk tier takes reserve no tier memory: they are written to their
    # record files from the staging segment, in one pass (Store.put_checked).
    assert disk_tier.metric("kvtier_server_requests_total", op="LocalStage", code="OK") >= 1
    assert disk_tier.metric("kvtier_ram_shared_bytes") == 0
    with RawLocal(disk_tier.local_socket, "") as raw:
        reply, _ = raw.reserve([MIB])
        assert reply.status == Status.OK and reply.count == 0
        reply, entries = raw.get([k for k, _ in items], flags=lw.FLAG_FILES)
        assert reply.status == Status.OK and reply.extra == 0  # no segment: the files rode on the entries
        assert [e.place for e in entries] == [Place.FILE] * len(items)
        for e, (key, data) in zip(entries, items, strict=True):
            assert e.length == len(data) and raw.read(e) == data
            stored_key = os.pread(e.fd, e.segment, e.offset)  # the record's key: the tenant's namespaced key
            assert stored_key.endswith(key) and e.checksum == lw.checksum(stored_key + data)
            assert stat.S_IMODE(os.fstat(e.fd).st_mode) == 0o400  # read-only to its owner too
            with pytest.raises(OSError):
                os.write(e.fd, b"x")  # a read-only descriptor
        # A client that does not ask for files (an older one) gets the bytes on the socket.
        reply, entries = raw.get([items[1][0]])
        assert [e.place for e in entries] == [Place.INLINE] and entries[0].inline == items[1][1]


def test_one_get_of_more_record_files_than_one_message_carries_gets_every_one(disk_tier: TierProcess) -> None:
    items = [(b"many%d" % i, value(100 + i, i)) for i in range(lw.MAX_FDS + 60)]
    with TierClient(disk_tier.target, local_socket=disk_tier.local_socket, data_path="local") as c:
        assert c.put(items) == len(items)
        assert as_bytes(c.get([k for k, _ in items])) == [v for _, v in items]
        assert as_bytes(c.get([k for k, _ in items])) == [v for _, v in items]  # no descriptor left over
    # The tier closes a reply's record files once its last message is sent, which can be
    # just after the client has read that message: wait for it, within a bound.
    assert wait_for(lambda: len(os.listdir(f"/proc/{disk_tier.proc.pid}/fd")) < 100, 10)  # closed what it sent


def test_a_record_file_replaced_or_deleted_after_the_reply_still_reads_whole(disk_tier: TierProcess) -> None:
    old, new = value(3 * MIB, 1), value(3 * MIB, 2)
    with TierClient(disk_tier.target, local_socket=disk_tier.local_socket, data_path="local") as c:
        c.put([(b"r", old), (b"gone", old)])
        with RawLocal(disk_tier.local_socket, "") as raw:
            _, (e_r, e_gone) = raw.get([b"r", b"gone"], flags=lw.FLAG_FILES)
            c.put([(b"r", new)])  # written aside, renamed over the old file
            assert c.delete([b"gone"]) == 1
            for e in (e_r, e_gone):
                assert raw.read(e) == old
                assert lw.read_checked(e.fd, e.offset, memoryview(bytearray(e.length)), e.segment) == e.checksum
        assert as_bytes(c.get([b"r", b"gone"])) == [new, None]


def test_one_reply_hands_over_segments_and_record_files_together(start_tier: Callable[..., TierProcess]) -> None:
    tier = start_tier("--ram-bytes", "3MiB", "--write-policy", "write-through", local_socket=True)
    in_ram, on_disk = value(MIB, 1), value(5 * MIB, 2)  # the second fits no RAM tier of 3 MiB
    with TierClient(tier.target, local_socket=tier.local_socket, data_path="local") as c:
        c.put([(b"ram", in_ram), (b"disk", on_disk)])
    with RawLocal(tier.local_socket, "") as raw:  # a new connection: the segment is handed over too
        reply, (e_ram, e_disk) = raw.get([b"ram", b"disk"], flags=lw.FLAG_FILES)
        assert reply.extra == 1 and (e_ram.place, e_disk.place) == (Place.SHARED, Place.FILE)
        assert raw.read(e_ram) == in_ram and raw.read(e_disk) == on_disk
        raw.release()
    with TierClient(tier.target, local_socket=tier.local_socket, data_path="local") as c:
        assert as_bytes(c.get([b"disk", b"ram"])) == [on_disk, in_ram]


def test_a_reply_hands_over_at_most_max_fds_record_files(disk_tier: TierProcess) -> None:
    data = value(100_000, 3)
    with TierClient(disk_tier.target, local_socket=disk_tier.local_socket, data_path="local") as c:
        c.put([(b"k", data)])
        keys = [b"k"] * (lw.MAX_FDS + 50)  # one key named again and again: a descriptor each time
        with RawLocal(disk_tier.local_socket, "") as raw:
            _, entries = raw.get(keys, flags=lw.FLAG_FILES)
            places = [e.place for e in entries]
            assert places == [Place.FILE] * lw.MAX_FDS + [Place.INLINE] * 50
            assert {raw.read(e) for e in entries} == {data}
        assert as_bytes(c.get(keys)) == [data] * len(keys)
    assert disk_tier.metric("kvtier_tier_errors_total", tier="disk", op="get") == 0


def test_no_record_files_while_the_client_has_not_read_what_it_was_sent(disk_tier: TierProcess) -> None:
    """Descriptors sent but not received count against the tier's own limit: a client that
    sends GETs without reading the replies gets one reply's files, then values inline."""
    data = value(200_000, 4)
    with TierClient(disk_tier.target, local_socket=disk_tier.local_socket, data_path="local") as c:
        c.put([(b"k", data)])
    with RawLocal(disk_tier.local_socket, "") as raw:
        for _ in range(2):
            raw.request(Op.GET, lw.key_table([b"k"]), 1, lw.FLAG_FILES)
        assert wait_for(lambda: disk_tier.metric("kvtier_server_requests_total", op="LocalGet", code="OK") == 2)
        first, second = (raw.read_get_reply() for _ in range(2))
        assert [e.place for e in first[1]] == [Place.FILE]
        assert [e.place for e in second[1]] == [Place.INLINE] and second[1][0].inline == data


@pytest.mark.parametrize("damage", ["a flipped value byte", "a truncated value"])
def test_a_corrupt_record_file_is_a_miss_and_deleted_and_its_bytes_never_returned(
    disk_tier: TierProcess, damage: str
) -> None:
    good = value(2 * MIB, 1)
    with TierClient(disk_tier.target, local_socket=disk_tier.local_socket, data_path="local") as c:
        c.put([(b"good", good)])
        for bad in (b"bad1", b"bad2"):
            before = set(record_files(disk_tier))
            c.put([(bad, value(2 * MIB, 2))])
            (path,) = set(record_files(disk_tier)) - before
            with path.open("r+b") as f:
                if damage == "a flipped value byte":  # found by the client's checksum
                    f.seek(-1000, os.SEEK_END)
                    byte = f.read(1)
                    f.seek(-1000, os.SEEK_END)
                    f.write(bytes([byte[0] ^ 0x40]))
                else:  # found by the tier's check of the header against the file's size
                    f.truncate(path.stat().st_size - 10)
        assert as_bytes(c.get([b"good", b"bad1", b"good"], stop_at_first_miss=False)) == [good, None, good]
        assert as_bytes(c.get([b"good", b"bad2", b"good"])) == [good, None]  # stops at the first miss
        assert record_files(disk_tier) == [p for p in before if p.exists()]  # both deleted
        assert c.lookup([b"bad1"]) == 0 and c.lookup([b"bad2"]) == 0
        assert as_bytes(c.get([b"good"])) == [good]
    failures = disk_tier.metric("kvtier_tier_verification_failures_total", tier="disk")
    deletes = disk_tier.metric("kvtier_server_requests_total", op="LocalDelete", code="OK")
    if damage == "a flipped value byte":  # the tier never read the value: the client found it, deleted it
        assert (failures, deletes) == (0, 2)
    else:  # the tier's check of the header against the file's size found it
        assert (failures, deletes) == (2, 0)


def test_record_files_are_a_tenants_own(start_tier: Callable[..., TierProcess], tokens_dir: Path) -> None:
    tier = start_tier(
        "--ram-bytes", "1", "--write-policy", "write-through", "--auth-tokens", str(tokens_dir),
        local_socket=True, data_port=True,
    )  # fmt: skip
    secret = value(MIB, 7)
    with (
        TierClient(tier.target, local_socket=tier.local_socket, token=TOKEN_A, data_path="local") as a,
        TierClient(tier.target, local_socket=tier.local_socket, token=TOKEN_B, data_path="local") as b,
    ):
        a.put([(b"k", secret)])
        assert as_bytes(b.get([b"k"])) == [None]
        assert as_bytes(a.get([b"k"])) == [secret]
    with RawLocal(tier.local_socket, f"Bearer {TOKEN_B}") as raw:
        _, (entry,) = raw.get([b"k"], flags=lw.FLAG_FILES)
        assert entry.place == Place.MISSING and raw.fds == []
