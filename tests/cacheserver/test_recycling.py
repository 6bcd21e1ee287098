"""The RAM tier recycles dropped values' buffers for new Puts (proto/kvtier/proto/buffers.py).

On real tier processes over real sockets: a recycled buffer never serves an old
value's bytes, a buffer some Get still sends is not recycled, and values plus
recycled buffers stay within --ram-bytes. The last tests drive a RamTier in
process to see which buffers it keeps.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator

import pytest

from kvtier.cacheserver.namespace import scoped
from kvtier.cacheserver.ram import RamTier
from kvtier.connector.client import TierClient
from kvtier.proto import datawire as dw
from kvtier.proto.datawire import Op, Status
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.waits import wait_for
from tests.cacheserver.test_dataport import raw_connect, read_reply, recv_exact, start_data_tier

MIB = 1 << 20
POOLED = "kvtier_ram_recycled_bytes"
REUSED = "kvtier_ram_recycled_buffers_reused_total"


def value(n: int, seed: int) -> bytes:
    return seed.to_bytes(4, "little") * (n // 4)


@pytest.fixture
def ram_tier(start_tier: Callable[..., TierProcess]) -> tuple[TierProcess, int]:
    """RAM only (no write-behind copy holds values), 64 MiB recycled at most."""
    return start_data_tier(start_tier, "--disk-bytes", "0", "--ram-recycle-bytes", "64MiB")


@pytest.fixture
def client(ram_tier: tuple[TierProcess, int]) -> Iterator[TierClient]:
    with TierClient(ram_tier[0].target, timeout_s=30, data_path="data") as c:
        yield c


def test_an_overwritten_values_buffer_receives_the_next_put_and_serves_only_its_bytes(
    ram_tier: tuple[TierProcess, int], client: TierClient
) -> None:
    tier, _ = ram_tier
    a, b, c = value(2 * MIB, 1), value(2 * MIB, 2), value(2 * MIB, 3)
    client.put([(b"k1", a)])
    client.put([(b"k1", b)])  # a's buffer is dropped: kept for the next Put of 2 MiB
    assert tier.metric(POOLED) == 2 * MIB
    client.put([(b"k2", c)])
    assert tier.metric(REUSED) == 1 and tier.metric(POOLED) == 0
    assert [bytes(v) for v in client.get([b"k1", b"k2"]) if v is not None] == [b, c]


def test_deleted_values_buffers_are_recycled_too(ram_tier: tuple[TierProcess, int], client: TierClient) -> None:
    tier, _ = ram_tier
    client.put([(b"k%d" % i, value(3 * MIB, i)) for i in range(3)])
    assert client.delete([b"k0", b"k1"]) == 2
    assert tier.metric(POOLED) == 6 * MIB
    client.put([(b"n%d" % i, value(3 * MIB, 10 + i)) for i in range(2)])
    assert tier.metric(REUSED) == 2
    got = client.get([b"k0", b"k2", b"n0", b"n1"], stop_at_first_miss=False)
    assert [None if v is None else bytes(v) for v in got] == [
        None, value(3 * MIB, 2), value(3 * MIB, 10), value(3 * MIB, 11)
    ]  # fmt: skip


def test_a_put_cut_inside_a_recycled_buffer_stores_nothing_and_serves_no_old_bytes(
    ram_tier: tuple[TierProcess, int], client: TierClient
) -> None:
    tier, port = ram_tier
    old, new = value(4 * MIB, 1), value(4 * MIB, 2)
    client.put([(b"k", old)])
    client.put([(b"k", new)])
    assert tier.metric(POOLED) == 4 * MIB  # old's bytes wait in the pool
    table = dw.put_table([(b"cut", 4 * MIB)])
    with raw_connect(port) as sock:
        sock.sendall(dw.request(Op.PUT, 1, len(table)) + table)
        assert read_reply(sock)[0] == Status.OK
        sock.sendall(value(MIB, 3))  # a quarter of the value, then the connection goes
    assert client.lookup([b"cut"]) == 0
    assert [bytes(v) for v in client.get([b"k"]) if v is not None] == [new]
    # Counted when the tier reads the end of the cut connection, which may come later.
    assert wait_for(lambda: tier.metric("kvtier_server_requests_total", op="DataPut", code="CANCELLED") == 1)


def test_a_value_still_being_sent_is_not_recycled_when_it_is_overwritten(
    ram_tier: tuple[TierProcess, int], client: TierClient
) -> None:
    tier, port = ram_tier
    size = 32 * MIB  # far more than the loopback socket buffers: the server's send waits for us
    original = value(size, 1)
    client.put([(b"k", original)])
    table = dw.get_table([b"k"])
    with raw_connect(port) as slow:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        slow.sendall(dw.request(Op.GET, 1, len(table)) + table)
        assert read_reply(slow)[0] == Status.OK
        # While the Get holds a view of the value, it is overwritten and a Put
        # of the same size follows: that Put must not get the value's buffer.
        client.put([(b"k", value(size, 2))])
        client.put([(b"other", value(size, 3))])
        assert tier.metric(REUSED) == 0
        found, length = dw.ENTRY.unpack(recv_exact(slow, dw.ENTRY.size))
        assert (found, length) == (1, size)
        assert recv_exact(slow, size) == original
    assert [bytes(v) for v in client.get([b"k"]) if v is not None] == [value(size, 2)]


def test_values_and_recycled_buffers_stay_within_the_ram_budget(start_tier: Callable[..., TierProcess]) -> None:
    tier, _ = start_data_tier(start_tier, "--disk-bytes", "0", "--ram-bytes", "16MiB")  # pool: 4MiB at most
    written: dict[bytes, bytes] = {}
    with TierClient(tier.target, timeout_s=30, data_path="data") as c:
        for i in range(40):
            key = b"k%d" % (i % 11)
            written[key] = value(2 * MIB, i)
            c.put([(key, written[key])])
            if i % 7 == 6:
                c.delete([b"k%d" % ((i + 3) % 11)])
                written.pop(b"k%d" % ((i + 3) % 11), None)
            used = tier.metric("kvtier_tier_used_bytes", tier="ram")
            pooled = tier.metric(POOLED)
            assert used + pooled <= 16 * MIB and pooled <= 4 * MIB
        assert tier.metric(REUSED) > 10
        keys = sorted(written)
        for key, got in zip(keys, c.get(keys, stop_at_first_miss=False), strict=True):
            assert got is None or bytes(got) == written[key]  # evicted, or exactly the last value


def test_multi_frame_grpc_puts_receive_into_recycled_buffers(ram_tier: tuple[TierProcess, int]) -> None:
    tier, _ = ram_tier
    a, b = value(6 * MIB, 1), value(6 * MIB, 2)  # larger than a 4 MiB frame: reassembled
    with TierClient(tier.target, timeout_s=30, data_path="grpc") as c:
        c.put([(b"k", a)])
        c.put([(b"k", a)])
        c.put([(b"j", b)])
        assert tier.metric(REUSED) == 1
        assert [bytes(v) for v in c.get([b"k", b"j"]) if v is not None] == [a, b]


# -- in process: which buffers the RAM tier keeps ---------------------------------------


def received(data: bytes) -> memoryview:
    """A value as the data port stores it: a read-only view of a whole received bytearray."""
    return memoryview(bytearray(data)).toreadonly()


async def test_a_buffer_some_view_still_sees_is_not_kept() -> None:
    ram = RamTier(64 * MIB, recycle_bytes=16 * MIB)
    await ram.put(b"k", received(os.urandom(2 * MIB)))
    held = await ram.get(b"k")
    sibling = memoryview(held)[MIB:]  # as a Get's send slices hold it
    del held
    await ram.delete([b"k"])
    assert ram.pool.bytes == 0
    assert sibling.nbytes == MIB  # still readable: the buffer was not handed out


async def test_a_full_tier_keeps_a_buffer_by_evicting_and_every_later_put_reuses_one() -> None:
    ram = RamTier(8 * MIB, recycle_bytes=2 * MIB)
    for i in range(4):  # the fourth fills the tier: the oldest value is evicted into the pool
        buf = ram.receive_buffer(2 * MIB, "default")
        buf[:] = value(2 * MIB, i)
        await ram.put(b"k%d" % i, memoryview(buf).toreadonly())
    assert (ram.lru.used, ram.pool.bytes, ram.pool.reused) == (6 * MIB, 2 * MIB, 0)
    for i in range(4, 10):
        buf = ram.receive_buffer(2 * MIB, "default")
        buf[:] = value(2 * MIB, i)
        await ram.put(b"k%d" % i, memoryview(buf).toreadonly())
        assert (ram.lru.used, ram.pool.bytes, ram.pool.reused) == (6 * MIB, 2 * MIB, i - 3)
    assert [bytes(v) for v in [await ram.get(b"k%d" % i) for i in (7, 8, 9)] if v is not None] == [
        value(2 * MIB, i) for i in (7, 8, 9)
    ]


async def test_a_pool_full_of_one_size_makes_room_for_the_next_size() -> None:
    """The newest buffers stay: 1 MiB buffers fill the pool, then 2 MiB values come."""
    ram = RamTier(256 * MIB, recycle_bytes=4 * MIB)
    for i in range(8):
        await ram.put(b"s%d" % i, received(value(MIB, i)))
    await ram.delete([b"s%d" % i for i in range(8)])
    assert ram.pool.bytes == 4 * MIB and ram.pool.reuse(2 * MIB) is None  # four 1 MiB buffers

    await ram.put(b"big", received(value(2 * MIB, 1)))
    await ram.put(b"big", received(value(2 * MIB, 2)))  # the first one's buffer is kept
    assert ram.pool.bytes == 4 * MIB  # two 1 MiB buffers made room for it
    buf = ram.receive_buffer(2 * MIB, "default")
    assert ram.pool.reused == 1 and bytes(buf) == value(2 * MIB, 1)  # the dropped value's memory
    assert ram.lru.used + ram.pool.bytes <= 256 * MIB


async def test_small_values_and_values_over_bytes_are_never_kept() -> None:
    ram = RamTier(64 * MIB, recycle_bytes=16 * MIB)
    await ram.put(b"small", received(b"x" * 1000))
    await ram.put(b"bytes", b"y" * (2 * MIB))
    await ram.delete([b"small", b"bytes"])
    assert ram.pool.bytes == 0 and len(ram.pool) == 0


async def test_tenant_quotas_never_evict_another_tenant_to_keep_buffers() -> None:
    ram = RamTier(8 * MIB, tenant_quota_bytes=4 * MIB, recycle_bytes=2 * MIB)
    a = [scoped("a", b"k%d" % i) for i in range(2)]
    b = [scoped("b", b"k%d" % i) for i in range(2)]
    for key in a + b:
        await ram.put(key, received(os.urandom(2 * MIB)))
    await ram.put(scoped("b", b"k0"), received(os.urandom(2 * MIB)))  # overwrite: b's old buffer is dropped
    await ram.put(scoped("b", b"k2"), received(os.urandom(2 * MIB)))  # full: b makes room from its own
    assert await ram.contains(a) == [True, True]
    assert ram.lru.used + ram.pool.bytes <= 8 * MIB


async def test_a_value_that_is_part_of_a_larger_buffer_evicts_nothing_for_the_pool() -> None:
    ram = RamTier(8 * MIB, recycle_bytes=2 * MIB)
    for i in range(3):
        await ram.put(b"k%d" % i, received(value(2 * MIB, i)))
    record = bytearray(24 + 2 * MIB)  # as the disk tier reads a record: header, then the value
    await ram.put(b"promoted", memoryview(record)[24:].toreadonly())
    assert await ram.contains([b"k0", b"k1", b"k2", b"promoted"]) == [True] * 4
    assert ram.counters.evictions == 0
