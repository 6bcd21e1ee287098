"""The Redis tier's own client for values (``redis_bulk``) against real redis-server processes.

The tier's behaviour through it (passwords, databases, TTLs, a full Redis, faults) is
tested in ``test_redis_tier.py``, which runs on it for every ``redis://`` and ``unix://``
URL; these tests pin what is its own: the bytes on the wire, replies received in pieces
into buffers that are reused only once free, connections that are never reused after a
failure, a timeout or a cancelled call, and which URLs use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.cacheserver.errors import TierFailure
from kvtier.cacheserver.readbuffers import ReadBuffers
from kvtier.cacheserver.redis_bulk import (
    BulkClient,
    LoopClient,
    RedisReplyError,
    SetupRefused,
    _aread_status,
)
from kvtier.cacheserver.redis_tier import BULK_SET_THREAD_MIN, KEY_PREFIX, RedisTier
from kvtier.testing.redisprocs import RedisClusterProcs, RedisServer, TlsFiles

MiB = 1 << 20


def raw(server: RedisServer) -> redis.Redis:
    return redis.Redis(unix_socket_path=str(server.unix_socket), password=server.password)


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[LoopClient]:
    c = LoopClient(host="127.0.0.1", port=redis_server.port, timeout_s=5.0)
    yield c
    c.close()


async def test_set_from_several_parts_stores_them_joined(
    client: LoopClient, redis_server: RedisServer
) -> None:
    parts = (b"head:", bytearray(b"\x00\r\n$-1\r\n" * 3), memoryview(os.urandom(3 * MiB + 7)))
    assert await client.set(b"k", parts)
    assert raw(redis_server).get(b"k") == b"".join(bytes(p) for p in parts)


async def test_get_reads_a_value_received_in_many_pieces(
    client: LoopClient, redis_server: RedisServer
) -> None:
    value = os.urandom(64 * MiB + 3)
    raw(redis_server).set(b"big", value)
    got = await client.get(b"big")
    assert got is not None and got.nbytes == len(value) and got == value


async def test_a_set_larger_than_the_socket_takes_at_once_waits_and_sends_it_whole(
    client: LoopClient, redis_server: RedisServer
) -> None:
    value = os.urandom(64 * MiB + 5)  # far more than a socket buffer: sendmsg takes a part
    assert await client.set(b"big", (value,))
    assert raw(redis_server).get(b"big") == value


@pytest.mark.parametrize("value", [b"", b"x", b"\r\n", b"$5\r\nhello\r\n"])
async def test_short_and_protocol_like_values_round_trip(client: LoopClient, value: bytes) -> None:
    assert await client.set(b"k", (value,))
    got = await client.get(b"k")
    assert got is not None and bytes(got) == value


async def test_get_of_a_missing_key_is_none(client: LoopClient) -> None:
    assert await client.get(b"nobody") is None


async def test_set_with_ex_sets_the_expiry(client: LoopClient, redis_server: RedisServer) -> None:
    assert await client.set(b"k", (b"v",), ex=100)
    assert 0 < raw(redis_server).ttl(b"k") <= 100


async def test_error_reply_raises_and_leaves_the_connection_usable(
    client: LoopClient, redis_server: RedisServer
) -> None:
    raw(redis_server).rpush(b"list", b"a")
    with pytest.raises(RedisReplyError) as err:
        await client.get(b"list")
    assert err.value.code == "WRONGTYPE"
    await client.set(b"k", (b"v",))
    assert await client.get(b"k") == b"v"
    assert len(client._idle) == 1  # the one connection, kept through the error


async def test_a_value_still_held_is_never_overwritten_by_the_next_get(
    client: LoopClient, redis_server: RedisServer
) -> None:
    a, b = os.urandom(2 * MiB), os.urandom(2 * MiB)
    r = raw(redis_server)
    r.set(b"a", a)
    r.set(b"b", b)
    held = await client.get(b"a")
    assert held is not None
    for _ in range(3):
        got_b = await client.get(b"b")
        assert got_b == b
        del got_b  # freed: its buffer may be reused by the next Get
    assert held == a  # the held view's buffer was never handed out again
    assert client.buffers.reused >= 2


async def test_buffers_of_freed_values_are_reused(redis_server: RedisServer) -> None:
    buffers = ReadBuffers()
    c = LoopClient(host="127.0.0.1", port=redis_server.port, timeout_s=5.0, buffers=buffers)
    try:
        raw(redis_server).set(b"k", os.urandom(4 * MiB))
        for _ in range(4):
            assert await c.get(b"k") is not None
        assert buffers.reused == 3
    finally:
        c.close()


async def test_concurrent_calls_each_get_their_own_value_on_a_connection_of_their_own(
    client: LoopClient,
) -> None:
    values = {b"k%d" % i: os.urandom(MiB + i) for i in range(8)}

    async def worker(key: bytes) -> None:
        for _ in range(5):
            assert await client.set(key, (values[key],))
            got = await client.get(key)
            assert got is not None and got == values[key]

    await asyncio.wait_for(asyncio.gather(*(worker(k) for k in values)), 60)
    assert 2 <= len(client._idle) <= len(values)  # calls overlapped, each on its own


async def test_calls_beyond_the_bound_wait_their_turn_on_as_many_connections(
    redis_server: RedisServer,
) -> None:
    c = LoopClient(host="127.0.0.1", port=redis_server.port, timeout_s=5.0, max_calls=4)
    try:
        values = {b"k%d" % i: os.urandom(MiB + i) for i in range(40)}
        assert all(await asyncio.gather(*(c.set(k, (v,)) for k, v in values.items())))
        got = await asyncio.gather(*(c.get(k) for k in values))
        assert [bytes(g) for g in got if g is not None] == list(values.values())
        assert len(c._idle) == 4  # 40 calls at once, 4 connections
        names = [x["name"] for x in raw(redis_server).client_list()]
        assert names.count("kvtier") == 4
    finally:
        c.close()


async def test_a_connection_the_server_dropped_is_replaced_once_transparently(
    client: LoopClient, redis_server: RedisServer
) -> None:
    await client.set(b"k", (b"v",))
    assert raw(redis_server).client_kill_filter(_type="normal", skipme=True) >= 1
    assert await client.get(b"k") == b"v"  # the stale pooled connection failed; a new one


async def test_restarted_server_is_served_at_once_however_many_connections_were_idle(
    client: LoopClient, redis_server: RedisServer
) -> None:
    value = os.urandom(4 * MiB)  # six SETs at once: six connections, then idle
    assert all(await asyncio.gather(*(client.set(b"k%d" % i, (value,)) for i in range(6))))
    assert len(client._idle) >= 2
    redis_server.restart()
    assert await client.get(b"k0") is None  # the first stale one failed: all dropped, a new one
    assert len(client._idle) == 1


async def test_restarted_server_is_served_by_new_connections(
    client: LoopClient, redis_server: RedisServer
) -> None:
    await client.set(b"k", (b"v",))
    redis_server.restart()  # a standalone server comes back empty
    assert await client.get(b"k") is None
    assert await client.set(b"k", (b"w",)) and await client.get(b"k") == b"w"


async def test_a_timed_out_connection_is_closed_not_reused(
    client: LoopClient, redis_server: RedisServer
) -> None:
    await client.set(b"k", (b"v",))
    client.timeout_s = 0.3
    redis_server.pause()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await client.get(b"k")
        assert time.monotonic() - start < 1.0
        assert client._idle == []  # it may hold the late reply: never reused
    finally:
        redis_server.resume()
    await client.set(b"k", (b"w",))  # on a new connection: a reused one would read "v"'s reply
    assert await client.get(b"k") == b"w"


async def test_a_cancelled_call_closes_its_connection(
    client: LoopClient, redis_server: RedisServer
) -> None:
    """A caller that goes away mid-call (the tier's request cancelled) leaves a connection
    that may hold half a request or a late reply: it is closed, never reused."""
    await client.set(b"k", (b"v",))
    redis_server.pause()
    try:
        call = asyncio.ensure_future(client.get(b"k"))
        await asyncio.sleep(0.2)  # sent, waiting for the reply
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert client._idle == []
    finally:
        redis_server.resume()
    await client.set(b"k", (b"w",))
    assert await client.get(b"k") == b"w"


async def test_a_call_cancelled_while_connecting_or_sending_leaves_nothing_open() -> None:
    """Cancelled during the handshake (a server that never answers it), or while the
    socket is full (one that reads nothing of a 64 MiB SET for a while): the client
    closes the socket (the server reads its end), no reader or writer stays on the
    loop, and the call's slot is free again."""
    hung_up: list[bool] = []

    def until_hung_up(conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            while conn.recv(1 << 20):
                pass
            hung_up.append(True)
        except TimeoutError:
            hung_up.append(False)

    def never_answers(conn: socket.socket) -> None:
        conn.recv(1024)  # CLIENT SETNAME
        until_hung_up(conn)

    def reads_late(conn: socket.socket) -> None:
        conn.recv(1024)
        conn.sendall(b"+OK\r\n")  # CLIENT SETNAME
        time.sleep(1)  # the SET fills the socket meanwhile
        until_hung_up(conn)

    selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    watched = set(selector.get_map())  # the loop's own (its wake-up pipe)
    for answer, call in ((never_answers, "get"), (reads_late, "set")):
        with against(answer, timeout_s=30.0) as c:
            task = asyncio.ensure_future(
                c.get(b"k") if call == "get" else c.set(b"k", (bytes(64 * MiB),))
            )
            await asyncio.sleep(0.5)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert c._idle == [] and c._slots._value == 16
            assert set(selector.get_map()) == watched  # no reader or writer left
            for _ in range(100):
                if len(hung_up) == 1:
                    break
                await asyncio.sleep(0.1)
            assert hung_up == [True]
            hung_up.clear()


async def test_an_error_reply_with_bytes_after_it_closes_the_connection() -> None:
    def error_and_more(conn: socket.socket) -> None:
        conn.recv(1024)
        conn.sendall(b"+OK\r\n")  # CLIENT SETNAME
        conn.recv(1024)
        conn.sendall(b"-ERR nope\r\n+OK\r\n")
        conn.recv(1024)

    with against(error_and_more) as c:
        with pytest.raises(ConnectionError, match="after an error reply"):
            await c.get(b"k")
        assert c._idle == []


async def test_a_protocol_error_reply_closes_the_connection_redis_closes(
    client: LoopClient, redis_server: RedisServer
) -> None:
    await client.set(b"k", (b"v",))
    with pytest.raises(RedisReplyError, match="Protocol error"):
        await client._call([b"*1\r\n$-5\r\n"], _aread_status)  # an invalid bulk length
    assert client._idle == []  # Redis hangs up after it: not kept
    assert await client.get(b"k") == b"v"


async def test_a_host_name_is_resolved_once_and_an_ip_address_never(
    redis_server: RedisServer,
) -> None:
    loop = asyncio.get_running_loop()
    looked_up: list[object] = []
    real = loop.getaddrinfo

    async def spy(*args: object, **kwargs: object) -> object:
        looked_up.append(args[0])
        return await real(*args, **kwargs)  # type: ignore[arg-type]

    loop.getaddrinfo = spy  # type: ignore[method-assign]
    try:
        for host in ("localhost", "127.0.0.1"):
            c = LoopClient(host=host, port=redis_server.port, timeout_s=5.0)
            try:
                for _ in range(3):  # three connections: every one dropped by the server
                    assert await c.set(b"k", (b"v",)) and await c.get(b"k") == b"v"
                    raw(redis_server).client_kill_filter(_type="normal", skipme=True)
            finally:
                c.close()
    finally:
        del loop.getaddrinfo
    assert looked_up == ["localhost"]


class Peer:
    """A listener on 127.0.0.1 that answers each connection with ``answer`` (a
    misbehaving Redis: one that hangs up, or trickles a reply), in a thread."""

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


@contextlib.contextmanager
def against(
    answer: Callable[[socket.socket], object],
    client: Callable[..., Any] = LoopClient,
    timeout_s: float = 5.0,
) -> Iterator[Any]:
    """A client (``LoopClient`` or ``BulkClient``) whose server is a ``Peer`` answering
    each connection with ``answer``."""
    peer = Peer(answer)
    c = client(host="127.0.0.1", port=peer.port, timeout_s=timeout_s)
    try:
        yield c
    finally:
        c.close()
        peer.close()


async def test_a_server_that_hangs_up_during_set_up_is_a_connection_error() -> None:
    def hang_up(conn: socket.socket) -> None:
        conn.recv(1024)  # CLIENT SETNAME, unanswered

    with against(hang_up) as c, pytest.raises(ConnectionError):
        await c.get(b"k")


async def test_a_reply_trickled_slower_than_the_timeout_fails_the_call_within_it() -> None:
    def trickle(conn: socket.socket) -> None:
        conn.recv(1024)
        conn.sendall(b"+OK\r\n")  # CLIENT SETNAME
        conn.recv(1024)
        conn.sendall(b"$100\r\n")
        for _ in range(100):  # a byte every 50 ms: each step is quick, the whole is not
            time.sleep(0.05)
            conn.sendall(b"x")

    with against(trickle, timeout_s=0.5) as c:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await c.get(b"k")
        assert time.monotonic() - start < 1.0
        assert c._idle == []


async def test_a_reply_that_is_not_resp_is_a_protocol_error_and_the_connection_closed() -> None:
    def garbage(conn: socket.socket) -> None:
        conn.recv(1024)
        conn.sendall(b"+OK\r\n")  # CLIENT SETNAME
        conn.recv(1024)
        conn.sendall(b"%3\r\nnot a bulk string\r\n")
        conn.recv(1024)  # until the client hangs up

    with against(garbage) as c:
        with pytest.raises(ConnectionError, match="bulk string"):
            await c.get(b"k")
        assert c._idle == []


async def test_an_empty_password_sends_no_auth(redis_server: RedisServer) -> None:
    c = LoopClient(host="127.0.0.1", port=redis_server.port, password="", timeout_s=5.0)
    try:
        assert await c.set(b"k", (b"v",)) and await c.get(b"k") == b"v"
    finally:
        c.close()


async def test_killed_server_fails_at_once_with_a_connection_error(
    client: LoopClient, redis_server: RedisServer
) -> None:
    await client.set(b"k", (b"v",))
    redis_server.kill()
    start = time.monotonic()
    with pytest.raises(ConnectionError):
        await client.get(b"k")
    assert time.monotonic() - start < 1.0


async def test_oom_refusal_returns_false(tmp_path: Path) -> None:
    server = RedisServer.start(
        tmp_path / "r", config={"maxmemory": "2mb", "maxmemory-policy": "noeviction"}
    )
    c = LoopClient(host="127.0.0.1", port=server.port, timeout_s=5.0)
    try:
        stored = [await c.set(b"k%d" % i, (bytes(256 << 10),)) for i in range(16)]
        assert stored[0] and not stored[-1]
        assert await c.get(b"k0") is not None  # the connection stays usable after -OOM
    finally:
        c.close()
        server.stop()


async def test_wrong_password_is_refused_at_set_up(tmp_path: Path) -> None:
    server = RedisServer.start(tmp_path / "r", password="right")
    c = LoopClient(host="127.0.0.1", port=server.port, password="wrong", timeout_s=5.0)
    try:
        with pytest.raises(SetupRefused, match="AUTH"):
            await c.get(b"k")
    finally:
        c.close()
        server.stop()


async def test_connections_are_named_kvtier(client: LoopClient, redis_server: RedisServer) -> None:
    await client.set(b"k", (b"v",))
    names = [c["name"] for c in raw(redis_server).client_list()]
    assert "kvtier" in names


async def test_closed_client_refuses_calls_and_keeps_no_connection(
    client: LoopClient, redis_server: RedisServer
) -> None:
    await client.set(b"k", (b"v",))
    client.close()
    assert client._idle == []
    with pytest.raises(ConnectionError):
        await client.get(b"k")


# --- the blocking client: SETs of large records, from worker threads --------------------


@pytest.fixture
def bulk(redis_server: RedisServer) -> Iterator[BulkClient]:
    c = BulkClient(host="127.0.0.1", port=redis_server.port, timeout_s=5.0)
    yield c
    c.close()


def test_blocking_set_from_several_parts_stores_them_joined_with_its_expiry(
    bulk: BulkClient, redis_server: RedisServer
) -> None:
    parts = (b"head:", bytearray(b"\x00\r\n$-1\r\n" * 3), memoryview(os.urandom(64 * MiB + 7)))
    assert bulk.set(b"k", parts, ex=100)
    assert raw(redis_server).get(b"k") == b"".join(bytes(p) for p in parts)
    assert 0 < raw(redis_server).ttl(b"k") <= 100


def test_blocking_sets_from_threads_each_store_their_own_value(
    bulk: BulkClient, redis_server: RedisServer
) -> None:
    values = {b"k%d" % i: os.urandom(MiB + i) for i in range(8)}
    errors: list[BaseException] = []

    def worker(key: bytes) -> None:
        try:
            for _ in range(5):
                assert bulk.set(key, (values[key],))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in values]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    r = raw(redis_server)
    assert all(r.get(k) == v for k, v in values.items())
    assert 1 <= len(bulk._idle) <= len(values)


def test_blocking_set_replaces_a_connection_the_server_dropped_once_transparently(
    bulk: BulkClient, redis_server: RedisServer
) -> None:
    assert bulk.set(b"k", (b"v",))
    assert raw(redis_server).client_kill_filter(_type="normal", skipme=True) >= 1
    assert bulk.set(b"k", (b"w",))  # the stale pooled connection failed; a new one
    assert raw(redis_server).get(b"k") == b"w"


def test_blocking_set_that_timed_out_closes_its_connection(
    bulk: BulkClient, redis_server: RedisServer
) -> None:
    assert bulk.set(b"k", (b"v",))
    bulk.timeout_s = 0.3
    redis_server.pause()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            bulk.set(b"k", (b"w",))
        assert time.monotonic() - start < 1.0
        assert bulk._idle == []  # it may hold the late reply: never reused
    finally:
        redis_server.resume()


def test_blocking_set_refused_for_memory_returns_false_and_a_wrong_password_at_set_up(
    tmp_path: Path,
) -> None:
    server = RedisServer.start(
        tmp_path / "r",
        config={"maxmemory": "2mb", "maxmemory-policy": "noeviction"},
        password="right",
    )
    c = BulkClient(host="127.0.0.1", port=server.port, password="right", timeout_s=5.0)
    wrong = BulkClient(host="127.0.0.1", port=server.port, password="wrong", timeout_s=5.0)
    try:
        stored = [c.set(b"k%d" % i, (bytes(256 << 10),)) for i in range(16)]
        assert stored[0] and not stored[-1]
        assert len(c._idle) == 1  # the connection stays usable after -OOM
        with pytest.raises(SetupRefused, match="AUTH"):
            wrong.set(b"k", (b"v",))
    finally:
        c.close()
        wrong.close()
        server.stop()


def test_blocking_client_that_hangs_up_during_set_up_is_a_connection_error() -> None:
    unanswered = against(lambda conn: conn.recv(1024), client=BulkClient)  # CLIENT SETNAME
    with unanswered as c, pytest.raises(ConnectionError):
        c.set(b"k", (b"v",))


def test_blocking_client_closed_refuses_calls_and_keeps_no_connection(bulk: BulkClient) -> None:
    assert bulk.set(b"k", (b"v",))
    bulk.close()
    assert bulk._idle == []
    with pytest.raises(ConnectionError):
        bulk.set(b"k", (b"v",))


# --- which URLs and values the tier uses them for ---------------------------------------


async def test_tier_gets_and_sets_values_on_the_loop_over_tcp_and_unix_sockets(
    redis_server: RedisServer,
) -> None:
    for url in (redis_server.url, redis_server.unix_url):
        t = RedisTier(url)

        async def no_redis_py(key: bytes, value: bytes | memoryview) -> bool:
            raise AssertionError("a value SET through redis-py")

        t._redis_py_set = no_redis_py  # type: ignore[method-assign]
        try:
            assert t._values is not None and t._bulk is not None
            values = {b"small": b"v", b"mib": os.urandom(MiB), b"4mib": os.urandom(4 * MiB)}
            for key, value in values.items():
                assert await t.put(key, value)
                assert len(t._values._idle) == 1  # the SET, on the loop's client
                assert await t.get(key) == value
            assert len(t._values._idle) == 1  # every call on it, one at a time
            assert t._bulk._idle == []  # none in a thread
        finally:
            await t.close()


async def test_tier_sets_records_from_the_thread_minimum_up_in_a_worker_thread(
    redis_server: RedisServer,
) -> None:
    t = RedisTier(redis_server.url, ttl_s=100)
    try:
        assert t._values is not None and t._bulk is not None
        value = os.urandom(BULK_SET_THREAD_MIN)
        assert await t.put(b"key", value)
        assert len(t._bulk._idle) == 1 and t._values._idle == []  # the SET, in a thread
        assert await t.get(b"key") == value
        assert len(t._values._idle) == 1  # the GET, on the loop
    finally:
        await t.close()
    assert 0 < raw(redis_server).ttl(KEY_PREFIX + b"key") <= 100


async def test_tier_megabyte_sets_overlap_on_the_loop_each_under_its_own_key(
    redis_server: RedisServer,
) -> None:
    t = RedisTier(redis_server.url)
    try:
        values = [os.urandom(MiB + i) for i in range(6)]
        stored = await asyncio.gather(*(t.put(b"k%d" % i, v) for i, v in enumerate(values)))
        assert stored == [True] * 6
        assert t._values is not None and len(t._values._idle) >= 2  # several in flight at once
        for i, value in enumerate(values):
            assert await t.get(b"k%d" % i) == value
    finally:
        await t.close()


async def test_tier_put_of_a_value_into_a_full_redis_returns_false(tmp_path: Path) -> None:
    server = RedisServer.start(
        tmp_path / "r", config={"maxmemory": "24mb", "maxmemory-policy": "noeviction"}
    )
    t = RedisTier(server.url)
    try:
        for size in (MiB, BULK_SET_THREAD_MIN):  # on the loop, then in a thread
            n = (24 << 20) // size + 2  # more than maxmemory holds
            stored = [await t.put(b"k%d-%d" % (size, i), bytes(size)) for i in range(n)]
            assert stored[0] and not stored[-1]
            await t.delete([b"k%d-%d" % (size, i) for i in range(n)])
        assert await t.put(b"after", b"v") and await t.get(b"after") == b"v"
    finally:
        await t.close()
        server.stop()


async def test_tier_closed_fails_calls_as_tier_failures(redis_server: RedisServer) -> None:
    t = RedisTier(redis_server.url)
    await t.close()
    with pytest.raises(TierFailure):
        await t.get(b"key")
    with pytest.raises(TierFailure):
        await t.put(b"key", bytes(BULK_SET_THREAD_MIN))


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
