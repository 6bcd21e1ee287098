"""The Redis tier's own client for values (``redis_bulk``) against real redis-server processes.

The tier's behaviour through it (passwords, databases, TTLs, a full Redis, faults) is
tested in ``test_redis_tier.py``, which runs on it for every ``redis://`` and ``unix://``
URL; these tests pin what is its own: the bytes on the wire, replies received in pieces
into buffers that are reused only once free, connections that are never reused after a
failure, and which URLs use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvtier.cacheserver.errors import TierFailure
from kvtier.cacheserver.readbuffers import ReadBuffers
from kvtier.cacheserver.redis_bulk import BulkClient, RedisReplyError, SetupRefused
from kvtier.cacheserver.redis_tier import BULK_SET_BUSY_MIN, BULK_SET_MIN, KEY_PREFIX, RedisTier
from kvtier.testing.redisprocs import RedisClusterProcs, RedisServer, TlsFiles

MiB = 1 << 20


def raw(server: RedisServer) -> redis.Redis:
    return redis.Redis(unix_socket_path=str(server.unix_socket), password=server.password)


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[BulkClient]:
    c = BulkClient(host="127.0.0.1", port=redis_server.port, timeout_s=5.0)
    yield c
    c.close()


def test_set_from_several_parts_stores_them_joined(
    client: BulkClient, redis_server: RedisServer
) -> None:
    parts = (b"head:", bytearray(b"\x00\r\n$-1\r\n" * 3), memoryview(os.urandom(3 * MiB + 7)))
    assert client.set(b"k", parts)
    assert raw(redis_server).get(b"k") == b"".join(bytes(p) for p in parts)


def test_get_reads_a_value_received_in_many_pieces(
    client: BulkClient, redis_server: RedisServer
) -> None:
    value = os.urandom(64 * MiB + 3)
    raw(redis_server).set(b"big", value)
    got = client.get(b"big")
    assert got is not None and got.nbytes == len(value) and got == value


@pytest.mark.parametrize("value", [b"", b"x", b"\r\n", b"$5\r\nhello\r\n"])
def test_short_and_protocol_like_values_round_trip(client: BulkClient, value: bytes) -> None:
    assert client.set(b"k", (value,))
    got = client.get(b"k")
    assert got is not None and bytes(got) == value


def test_get_of_a_missing_key_is_none(client: BulkClient) -> None:
    assert client.get(b"nobody") is None


def test_set_with_ex_sets_the_expiry(client: BulkClient, redis_server: RedisServer) -> None:
    assert client.set(b"k", (b"v",), ex=100)
    assert 0 < raw(redis_server).ttl(b"k") <= 100


def test_error_reply_raises_and_leaves_the_connection_usable(
    client: BulkClient, redis_server: RedisServer
) -> None:
    raw(redis_server).rpush(b"list", b"a")
    with pytest.raises(RedisReplyError) as err:
        client.get(b"list")
    assert err.value.code == "WRONGTYPE"
    client.set(b"k", (b"v",))
    assert client.get(b"k") == b"v"
    assert len(client._idle) == 1  # the one connection, kept through the error


def test_a_value_still_held_is_never_overwritten_by_the_next_get(
    client: BulkClient, redis_server: RedisServer
) -> None:
    a, b = os.urandom(2 * MiB), os.urandom(2 * MiB)
    r = raw(redis_server)
    r.set(b"a", a)
    r.set(b"b", b)
    held = client.get(b"a")
    assert held is not None
    for _ in range(3):
        got_b = client.get(b"b")
        assert got_b == b
        del got_b  # freed: its buffer may be reused by the next Get
    assert held == a  # the held view's buffer was never handed out again
    assert client.buffers.reused >= 2


def test_buffers_of_freed_values_are_reused(redis_server: RedisServer) -> None:
    buffers = ReadBuffers()
    c = BulkClient(host="127.0.0.1", port=redis_server.port, timeout_s=5.0, buffers=buffers)
    try:
        raw(redis_server).set(b"k", os.urandom(4 * MiB))
        for _ in range(4):
            assert c.get(b"k") is not None
        assert buffers.reused == 3
    finally:
        c.close()


def test_concurrent_calls_from_threads_each_get_their_own_value(client: BulkClient) -> None:
    values = {b"k%d" % i: os.urandom(MiB + i) for i in range(8)}
    errors: list[BaseException] = []

    def worker(key: bytes) -> None:
        try:
            for _ in range(5):
                assert client.set(key, (values[key],))
                got = client.get(key)
                assert got is not None and got == values[key]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in values]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert 1 <= len(client._idle) <= len(values)


def test_a_connection_the_server_dropped_is_replaced_once_transparently(
    client: BulkClient, redis_server: RedisServer
) -> None:
    client.set(b"k", (b"v",))
    assert raw(redis_server).client_kill_filter(_type="normal", skipme=True) >= 1
    assert client.get(b"k") == b"v"  # the stale pooled connection failed; a new one answered


def test_restarted_server_is_served_at_once_however_many_connections_were_idle(
    client: BulkClient, redis_server: RedisServer
) -> None:
    held = threading.Barrier(6)

    def hold_one() -> None:  # six calls at once: six connections, then idle
        held.wait()
        assert client.set(b"k", (b"v",))

    threads = [threading.Thread(target=hold_one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(client._idle) >= 2
    redis_server.restart()
    assert client.get(b"k") is None  # the first stale one failed: all dropped, a new one
    assert len(client._idle) == 1


def test_restarted_server_is_served_by_new_connections(
    client: BulkClient, redis_server: RedisServer
) -> None:
    client.set(b"k", (b"v",))
    redis_server.restart()  # a standalone server comes back empty
    assert client.get(b"k") is None
    assert client.set(b"k", (b"w",)) and client.get(b"k") == b"w"


def test_a_timed_out_connection_is_closed_not_reused(
    client: BulkClient, redis_server: RedisServer
) -> None:
    client.set(b"k", (b"v",))
    client.timeout_s = 0.3
    redis_server.pause()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            client.get(b"k")
        assert time.monotonic() - start < 1.0
        assert client._idle == []  # it may hold the late reply: never reused
    finally:
        redis_server.resume()
    client.set(b"k", (b"w",))  # on a new connection: a reused one would read "v"'s GET reply
    assert client.get(b"k") == b"w"


class Peer:
    """A listener on 127.0.0.1 that answers each connection with ``answer`` (a
    misbehaving Redis: one that hangs up, or trickles a reply)."""

    def __init__(self, answer) -> None:  # type: ignore[no-untyped-def]
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.answer = answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                with conn, contextlib.suppress(OSError):
                    self.answer(conn)

    def close(self) -> None:
        self.listener.close()


def test_a_server_that_hangs_up_during_set_up_is_a_connection_error() -> None:
    def hang_up(conn: socket.socket) -> None:
        conn.recv(1024)  # CLIENT SETNAME, unanswered

    peer = Peer(hang_up)
    c = BulkClient(host="127.0.0.1", port=peer.port, timeout_s=5.0)
    try:
        with pytest.raises(ConnectionError):
            c.get(b"k")
    finally:
        c.close()
        peer.close()


def test_a_reply_trickled_slower_than_the_timeout_fails_the_call_within_it() -> None:
    def trickle(conn: socket.socket) -> None:
        conn.recv(1024)
        conn.sendall(b"+OK\r\n")  # CLIENT SETNAME
        conn.recv(1024)
        conn.sendall(b"$100\r\n")
        for _ in range(100):  # a byte every 50 ms: each step is quick, the whole is not
            time.sleep(0.05)
            conn.sendall(b"x")

    peer = Peer(trickle)
    c = BulkClient(host="127.0.0.1", port=peer.port, timeout_s=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            c.get(b"k")
        assert time.monotonic() - start < 1.0
        assert c._idle == []
    finally:
        c.close()
        peer.close()


def test_an_empty_password_sends_no_auth(redis_server: RedisServer) -> None:
    c = BulkClient(host="127.0.0.1", port=redis_server.port, password="", timeout_s=5.0)
    try:
        assert c.set(b"k", (b"v",)) and c.get(b"k") == b"v"
    finally:
        c.close()


def test_killed_server_fails_at_once_with_a_connection_error(
    client: BulkClient, redis_server: RedisServer
) -> None:
    client.set(b"k", (b"v",))
    redis_server.kill()
    start = time.monotonic()
    with pytest.raises(ConnectionError):
        client.get(b"k")
    assert time.monotonic() - start < 1.0


def test_oom_refusal_returns_false(tmp_path: Path) -> None:
    server = RedisServer.start(
        tmp_path / "r", config={"maxmemory": "2mb", "maxmemory-policy": "noeviction"}
    )
    c = BulkClient(host="127.0.0.1", port=server.port, timeout_s=5.0)
    try:
        stored = [c.set(b"k%d" % i, (bytes(256 << 10),)) for i in range(16)]
        assert stored[0] and not stored[-1]
        assert c.get(b"k0") is not None  # the connection stays usable after -OOM
    finally:
        c.close()
        server.stop()


def test_wrong_password_is_refused_at_set_up(tmp_path: Path) -> None:
    server = RedisServer.start(tmp_path / "r", password="right")
    c = BulkClient(host="127.0.0.1", port=server.port, password="wrong", timeout_s=5.0)
    try:
        with pytest.raises(SetupRefused, match="AUTH"):
            c.get(b"k")
    finally:
        c.close()
        server.stop()


def test_connections_are_named_kvtier(client: BulkClient, redis_server: RedisServer) -> None:
    client.set(b"k", (b"v",))
    names = [c["name"] for c in raw(redis_server).client_list()]
    assert "kvtier" in names


def test_closed_client_refuses_calls_and_keeps_no_connection(
    client: BulkClient, redis_server: RedisServer
) -> None:
    client.set(b"k", (b"v",))
    client.close()
    assert client._idle == []
    with pytest.raises(ConnectionError):
        client.get(b"k")


# --- which URLs and values the tier uses it for -------------------------------------


async def test_tier_stores_large_values_through_it_over_tcp_and_unix_sockets(
    redis_server: RedisServer,
) -> None:
    for url in (redis_server.url, redis_server.unix_url):
        t = RedisTier(url)
        try:
            assert t._bulk is not None
            value = os.urandom(BULK_SET_MIN)
            assert await t.put(b"key", value)
            assert len(t._bulk._idle) == 1  # the SET went over the tier's own client
            assert await t.get(b"key") == value
        finally:
            await t.close()


async def test_tier_sets_small_values_through_redis_py_and_gets_them_through_it(
    redis_server: RedisServer,
) -> None:
    t = RedisTier(redis_server.url)
    try:
        assert t._bulk is not None
        assert await t.put(b"key", b"small")
        assert t._bulk._idle == []  # no connection of its own yet: redis-py sent the SET
        assert await t.get(b"key") == b"small"
        assert len(t._bulk._idle) == 1
    finally:
        await t.close()


async def test_tier_sets_a_ttl_on_large_values_too(redis_server: RedisServer) -> None:
    t = RedisTier(redis_server.url, ttl_s=100)
    try:
        assert await t.put(b"key", bytes(BULK_SET_MIN))
    finally:
        await t.close()
    assert 0 < raw(redis_server).ttl(KEY_PREFIX + b"key") <= 100


async def test_tier_megabyte_sets_take_the_own_client_only_while_another_set_is_in_flight(
    redis_server: RedisServer,
) -> None:
    t = RedisTier(redis_server.url)
    own: list[bytes] = []  # keys the tier's own client SET (the real call, observed)
    real_set = t._bulk_set

    def observed(key: bytes, value: bytes | memoryview) -> bool:
        own.append(key)
        return real_set(key, value)

    t._bulk_set = observed  # type: ignore[method-assign]
    try:
        alone = os.urandom(BULK_SET_BUSY_MIN)
        assert await t.put(b"alone", alone)
        assert own == []  # an idle tier: through redis-py, no thread hop
        values = [os.urandom(BULK_SET_BUSY_MIN + i) for i in range(4)]
        stored = await asyncio.gather(*(t.put(b"k%d" % i, v) for i, v in enumerate(values)))
        assert stored == [True] * 4
        assert sorted(own) == [b"k1", b"k2", b"k3"]  # each SET after the first found one in flight
        for i, value in enumerate(values):
            assert await t.get(b"k%d" % i) == value  # each whole, under its own key
        assert await t.get(b"alone") == alone
        assert await t.put(b"big", bytes(BULK_SET_MIN))
        assert own[-1] == b"big"  # large ones always
    finally:
        await t.close()


async def test_tier_put_of_a_large_value_into_a_full_redis_returns_false(tmp_path: Path) -> None:
    server = RedisServer.start(
        tmp_path / "r", config={"maxmemory": "12mb", "maxmemory-policy": "noeviction"}
    )
    t = RedisTier(server.url)
    try:
        n = (12 << 20) // BULK_SET_MIN + 2  # more than maxmemory holds
        stored = [await t.put(b"k%d" % i, bytes(BULK_SET_MIN)) for i in range(n)]
        assert stored[0] and not stored[-1]
        assert await t.get(b"k0") == bytes(BULK_SET_MIN)
    finally:
        await t.close()
        server.stop()


async def test_tier_closed_fails_calls_as_tier_failures(redis_server: RedisServer) -> None:
    t = RedisTier(redis_server.url)
    await t.close()
    with pytest.raises(TierFailure):
        await t.get(b"key")
    with pytest.raises(TierFailure):
        await t.put(b"key", bytes(BULK_SET_MIN))


async def test_tier_on_a_db_number_selects_it_on_its_own_connections(
    redis_server: RedisServer,
) -> None:
    t = RedisTier(redis_server.url + "/3")
    try:
        assert await t.put(b"key", b"v")
    finally:
        await t.close()
    assert redis.Redis(port=redis_server.port, db=3).exists(KEY_PREFIX + b"key") == 1
    assert redis.Redis(port=redis_server.port, db=0).exists(KEY_PREFIX + b"key") == 0


async def test_tier_over_tls_or_on_a_cluster_stays_on_redis_py(
    redis_tls: RedisServer, tls_files: TlsFiles, redis_cluster: RedisClusterProcs
) -> None:
    tls = RedisTier(redis_tls.tls_url, tls_ca_file=str(tls_files.ca))
    cluster = RedisTier(redis_cluster.url)
    try:
        assert tls._bulk is None and cluster._bulk is None
        assert await tls.put(b"key", b"v") and await tls.get(b"key") == b"v"
    finally:
        await tls.close()
        await cluster.close()
