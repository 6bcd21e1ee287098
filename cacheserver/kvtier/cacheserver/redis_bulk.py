"""The Redis tier's own clients for values: ``GET`` and ``SET`` of records with no copy of a
value in Python.

redis-py's asyncio client copies a ``SET``'s value three times in Python (the record's
``head + value``, ``writelines``' join, the transport's buffer) and takes a ``GET``
reply in 64 KiB pieces that it joins: for values of megabytes that, not Redis, was the
Redis tier's cost (docs/benchmarks.md, "Redis tier against redis-py, disk tier against
plain files"). Here a ``SET`` is ``sendmsg`` of the command's head, the record's header
and the value's own memory (the kernel copies it once, into the socket); a ``GET`` reply
is received straight into a buffer of ``ReadBuffers``, reused once nothing holds the
value read into it.

Two clients, one per way of waiting, with the same commands and rules:

- ``LoopClient`` runs on the event loop, on non-blocking sockets: every ``GET``, and
  ``SET`` of records under ``BULK_SET_THREAD_MIN`` (``redis_tier``). No hop to a thread
  and back adds to a call's latency (docs/benchmarks.md, "The Redis tier's calls on the
  event loop": 1 MiB calls from one client gained 0.1-0.3 of redis-py's speed).
- ``BulkClient`` blocks, in the tier's worker threads: ``SET`` of larger records, whose
  one ``sendmsg`` copies tens of MiB without the GIL, beside the event loop, on the other
  core (on the loop the same ``SET`` waited on the socket dozens of times and ran 5-20%
  slower).

Only standalone servers over TCP or a unix socket without TLS use them (``RedisTier``
picks them); the rest of the tier's commands (``EXISTS``, ``DEL``, ``INFO``, the quota
ledger's scripts and its ``GET``) stay on redis-py, as do Cluster and TLS.

Connections: a pool of idle ones per client; a call takes one (or connects: ``AUTH`` when
there is a password, ``SELECT`` when the database is not 0, ``CLIENT SETNAME kvtier``)
and gives it back after a whole reply. A call, the connecting and the whole value's
transfer included, is bounded by ``timeout_s`` (``LoopClient``: each attempt as a whole;
``BulkClient``: each socket step waits at most that long, and no step starts once the
call has taken that long, at most about twice it in all; both: a call retried on a new
connection, below, starts that bound again). ``LoopClient``'s wait for one of its
``max_calls`` slots is not part of it, as a wait for a worker thread is not. A connection that failed in
any way, timed out or whose call was cancelled is closed, never reused: it may hold half
a reply. A call that fails with a broken connection taken from the pool (a restarted
server leaves stale ones) closes every idle connection and is tried once more on a new
one, as redis-py's retry does; a timeout is not retried. Every failure is an ``OSError``
(``ConnectionError``, ``TimeoutError``) but a whole error reply from Redis,
``RedisReplyError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Self, TypeVar

from typing_extensions import Buffer

from kvtier.cacheserver.readbuffers import ReadBuffers

_CRLF = b"\r\n"
_HEAD_BYTES = 64 << 10  # the first receive of a reply: its type line and a value's start

T = TypeVar("T")


class RedisReplyError(Exception):
    """Redis answered with an error (``-ERR ...``); ``code`` is its first word."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = message.split(" ", 1)[0]


class SetupRefused(ConnectionError):
    """Redis refused a new connection's ``AUTH``, ``SELECT`` or ``CLIENT SETNAME``."""


class ClosedByServer(ConnectionError):
    """Redis closed the connection (a reply cut short, or none at all)."""


class ProtocolError(ConnectionError):
    """A reply that is not RESP as expected: the connection is closed."""


class _Client:
    """Where a client connects, what a new connection sends first, and the idle
    connections of its pool."""

    def __init__(
        self,
        *,
        host: str | None = None,
        port: int = 6379,
        path: str | None = None,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        timeout_s: float,
        client_name: str = "kvtier",
    ) -> None:
        if (host is None) == (path is None):
            raise ValueError(f"{type(self).__name__} needs a host (TCP) or a path (unix socket)")
        self.host, self.port, self.path = host, port, path
        self.timeout_s = timeout_s
        self._hello = _handshake(username, password, db, client_name)
        self._idle: list[socket.socket] = []
        self._closed = False

    @classmethod
    def from_url_kwargs(cls, kwargs: dict[str, Any], timeout_s: float) -> Self:
        """A client for what redis-py's ``parse_url`` read from a ``redis://`` or
        ``unix://`` URL (plus the tier's ``password``, which wins)."""
        common: dict[str, Any] = {
            "username": kwargs.get("username"),
            "password": kwargs.get("password"),
            "db": int(kwargs.get("db", 0) or 0),
            "timeout_s": timeout_s,
        }
        if kwargs.get("path"):
            return cls(path=kwargs["path"], **common)
        host, port = kwargs.get("host") or "localhost", int(kwargs.get("port") or 6379)
        return cls(host=host, port=port, **common)

    def _give_back(self, sock: socket.socket) -> None:
        if self._closed:
            sock.close()
        else:
            self._idle.append(sock)

    def _after_error_reply(self, sock: socket.socket, exc: RedisReplyError) -> None:
        """A whole error reply leaves the connection fine, but for a protocol error (a
        value over ``proto-max-bulk-len``), after which Redis closes it."""
        if str(exc).startswith("ERR Protocol error"):
            sock.close()
        else:
            self._give_back(sock)


class BulkClient(_Client):
    """``SET`` of one Redis server, blocking: call from worker threads."""

    def __init__(self, **target: Any) -> None:
        super().__init__(**target)
        self._lock = threading.Lock()

    def set(self, name: bytes, parts: tuple[Buffer, ...], ex: int = 0) -> bool:
        """``SET name <parts joined>`` (``EX ex`` when ``ex``), sent from the parts' own
        memory. False when Redis refuses it for memory (``-OOM``: full, ``noeviction``)."""
        return self._call(_set_request(name, parts, ex))

    def close(self) -> None:
        with self._lock:
            self._closed = True  # connections given back from now on are closed
        self._drop_idle()

    # --- connections -----------------------------------------------------------------

    def _call(self, request: list[Buffer]) -> bool:
        """Sends a ``SET`` and reads its reply (``_set_reply``)."""
        for attempt in (0, 1):
            deadline = time.monotonic() + self.timeout_s
            sock = self._idle_socket(reuse=attempt == 0)
            reused = sock is not None
            if sock is None:
                sock = self._connect(deadline)
            try:
                sock.settimeout(self.timeout_s)
                _send_all(sock, request, deadline)
                reply = _set_reply(*_read_line(sock, bytearray(_HEAD_BYTES), deadline))
            except RedisReplyError as exc:
                self._after_error_reply(sock, exc)
                raise
            except ConnectionError:
                sock.close()
                if reused:  # a stale connection (the server restarted): the other idle
                    self._drop_idle()  # ones are as stale; once more, on a new one
                    continue
                raise
            except BaseException:
                sock.close()  # a timeout or anything else: it may hold half a reply
                raise
            self._give_back(sock)
            return reply
        raise AssertionError("unreachable")

    def _idle_socket(self, reuse: bool) -> socket.socket | None:
        with self._lock:
            if self._closed:
                raise ConnectionError("client closed")
            return self._idle.pop() if reuse and self._idle else None

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(sock)
                return
        sock.close()

    def _connect(self, deadline: float) -> socket.socket:
        if self.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.timeout_s)
                sock.connect(self.path)
            except BaseException:
                sock.close()
                raise
        else:
            assert self.host is not None
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        try:
            if self.path is None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for command, what in self._hello:  # one at a time: a rare, small round trip
                _send_all(sock, [command], deadline)
                try:
                    _read_status(sock, deadline)
                except RedisReplyError as exc:
                    raise SetupRefused(f"Redis refused {what} ({exc.code})") from None
        except BaseException:
            sock.close()
            raise
        return sock


class LoopClient(_Client):
    """``GET`` and ``SET`` of one Redis server on the event loop, on non-blocking sockets
    the loop waits on, with no worker thread: the same commands, pool, retry and failure
    rules as ``BulkClient`` (the module docstring), up to ``max_calls`` calls at once,
    each attempt bounded as a whole by ``timeout_s``."""

    def __init__(
        self, *, buffers: ReadBuffers | None = None, max_calls: int = 16, **target: Any
    ) -> None:
        super().__init__(**target)
        self.buffers = buffers if buffers is not None else ReadBuffers()
        # Calls in flight at once, each on a connection of its own (so at most this many
        # connections); more wait their turn, not counted in their ``timeout_s``.
        self._slots = asyncio.Semaphore(max_calls)
        self._targets: list[tuple[int, Any]] | None = None  # (family, address) to connect to

    async def get(self, name: bytes) -> memoryview | None:
        """The value of ``name`` (a view of a buffer of ``buffers``), None when unset."""
        return await self._call(
            [_command(b"GET", name)], functools.partial(_aread_bulk, buffers=self.buffers)
        )

    async def set(self, name: bytes, parts: tuple[Buffer, ...], ex: int = 0) -> bool:
        """As ``BulkClient.set``."""
        return await self._call(_set_request(name, parts, ex), _aread_set_reply)

    def close(self) -> None:
        self._closed = True
        self._drop_idle()

    async def _call(
        self,
        request: list[Buffer],
        read: Callable[[asyncio.AbstractEventLoop, socket.socket], Awaitable[T]],
    ) -> T:
        async with self._slots:
            return await self._call_now(request, read)

    async def _call_now(
        self,
        request: list[Buffer],
        read: Callable[[asyncio.AbstractEventLoop, socket.socket], Awaitable[T]],
    ) -> T:
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            if self._closed:
                raise ConnectionError("client closed")
            sock = self._idle.pop() if attempt == 0 and self._idle else None
            reused = sock is not None
            try:
                async with asyncio.timeout(self.timeout_s):
                    if sock is None:
                        sock = await self._connect(loop)
                    await _asend_all(loop, sock, request)
                    reply = await read(loop, sock)
            except RedisReplyError as exc:
                assert sock is not None
                self._after_error_reply(sock, exc)
                raise
            except ConnectionError:
                if sock is not None:
                    sock.close()
                if reused:  # a stale connection (the server restarted): the other idle
                    self._drop_idle()  # ones are as stale; once more, on a new one
                    continue
                raise
            except BaseException:  # a timeout, a cancelled call: it may hold half a reply
                if sock is not None:
                    sock.close()
                raise
            self._give_back(sock)
            return reply
        raise AssertionError("unreachable")

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    async def _resolve(self, loop: asyncio.AbstractEventLoop) -> list[tuple[int, Any]]:
        """Where to connect: the unix socket's path or an IP address as they are, a host
        name's addresses resolved once (in the loop's default executor, which the disk
        tier's reads share) and again only after none of them answered."""
        if self._targets is None:
            if self.path is not None:
                self._targets = [(socket.AF_UNIX, self.path)]
            elif (ip := _ip_family(self.host)) is not None:
                self._targets = [(ip, (self.host, self.port))]
            else:
                found = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                self._targets = [(family, address) for family, _, _, _, address in found]
        return self._targets

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> socket.socket:
        targets = await self._resolve(loop)
        self._targets = None  # until one of them answers
        error: OSError = ConnectionError("no address to connect to")
        for family, address in targets:  # as socket.create_connection: each in turn
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                await loop.sock_connect(sock, address)
                if family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for command, what in self._hello:
                    await _asend_all(loop, sock, [command])
                    try:
                        await _aread_status(loop, sock)
                    except RedisReplyError as exc:
                        raise SetupRefused(f"Redis refused {what} ({exc.code})") from None
                self._targets = targets
                return sock
            except SetupRefused:
                sock.close()
                raise
            except OSError as exc:
                sock.close()
                error = exc
            except BaseException:
                sock.close()
                raise
        raise error


def _ip_family(host: str | None) -> int | None:
    """The address family of an IP address, None for a host name."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host or "").version == 6 else socket.AF_INET
    except ValueError:
        return None


def _set_request(name: bytes, parts: tuple[Buffer, ...], ex: int) -> list[Buffer]:
    """``SET name <parts joined> [EX ex]`` as the buffers to send: the value's own parts
    between the command's head and tail."""
    size = sum(memoryview(p).nbytes for p in parts)
    args = 5 if ex else 3
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (args, len(name), name, size)
    seconds = str(ex).encode()
    tail = b"\r\n$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(seconds), seconds) if ex else _CRLF
    return [head, *parts, tail]


def _handshake(
    username: str | None, password: str | None, db: int, client_name: str
) -> list[tuple[bytes, str]]:
    """The commands a new connection sends first, each with what it sets up."""
    hello: list[tuple[bytes, str]] = []
    if username or password:  # as redis-py: an empty password sends no AUTH
        secret = (password or "").encode()
        creds = [username.encode(), secret] if username else [secret]
        hello.append((_command(b"AUTH", *creds), "AUTH"))
    if db:
        hello.append((_command(b"SELECT", str(db).encode()), "SELECT"))
    hello.append((_command(b"CLIENT", b"SETNAME", client_name.encode()), "CLIENT SETNAME"))
    return hello


def _command(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


def _check(deadline: float) -> None:
    """Raises TimeoutError once the call's time is up. (Checked between socket steps; the
    socket's timeout is set once per call: ``settimeout`` before every step cost 1 MiB
    GETs a fifth in an A/B, same-node 1.06-1.10 -> 0.79-0.85 of redis-py, presumably as
    each one releases and takes back the GIL once more.)"""
    if time.monotonic() > deadline:
        raise TimeoutError("the Redis call took longer than its timeout")


def _send_all(sock: socket.socket, parts: list[Buffer], deadline: float) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if v.nbytes]
    while views:
        _check(deadline)
        _advance(views, sock.sendmsg(views[:512]))  # (IOV_MAX is 1024)


def _advance(views: list[memoryview], sent: int) -> None:
    """Drops from ``views`` the ``sent`` bytes a ``sendmsg`` took."""
    while sent and views:
        first = views[0]
        if sent >= first.nbytes:
            sent -= first.nbytes
            views.pop(0)
        else:
            views[0] = first[sent:]
            sent = 0


def _read_line(sock: socket.socket, into: bytearray, deadline: float) -> tuple[bytes, memoryview]:
    """Receives until a reply's first line is complete: that line (without CRLF) and the
    bytes received after it."""
    got = 0
    view = memoryview(into)
    while True:
        _check(deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ClosedByServer("Redis closed the connection")
        got += n
        if (found := _line_in(into, got)) is not None:
            return found


def _read_status(sock: socket.socket, deadline: float) -> bytes:
    return _status(*_read_line(sock, bytearray(_HEAD_BYTES), deadline))


async def _asend_all(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, parts: list[Buffer]
) -> None:
    """``_send_all`` on a non-blocking socket: as much as the socket takes, then a wait
    until it takes more."""
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if v.nbytes]
    while views:
        with contextlib.suppress(BlockingIOError):  # (then it took nothing)
            _advance(views, sock.sendmsg(views[:512]))
        if views:
            writable = loop.create_future()
            loop.add_writer(sock, _wake, writable)
            try:
                await writable
            finally:
                loop.remove_writer(sock)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # (cancelled by a callback of the same loop iteration)
        waiter.set_result(None)


async def _aread_line(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, into: bytearray
) -> tuple[bytes, memoryview]:
    """``_read_line`` on a non-blocking socket."""
    got = 0
    view = memoryview(into)
    while True:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ClosedByServer("Redis closed the connection")
        got += n
        if (found := _line_in(into, got)) is not None:
            return found


async def _aread_status(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    return _status(*await _aread_line(loop, sock, bytearray(_HEAD_BYTES)))


async def _aread_set_reply(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bool:
    return _set_reply(*await _aread_line(loop, sock, bytearray(_HEAD_BYTES)))


async def _aread_bulk(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, buffers: ReadBuffers
) -> memoryview | None:
    start = _bulk_start(*await _aread_line(loop, sock, bytearray(_HEAD_BYTES)), buffers)
    if start is None:
        return None
    view, size, got = start
    while got < size + 2:  # the value, then CRLF
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ClosedByServer("Redis closed the connection mid-reply")
        got += n
    return _bulk_value(view, size)


# --- replies, whichever way their bytes arrive ------------------------------------------


def _line_in(into: bytearray, got: int) -> tuple[bytes, memoryview] | None:
    """A reply's first line (without CRLF) and the bytes after it, once ``into[:got]``
    holds that line; None before."""
    end = into.find(_CRLF, 0, got)
    if end >= 0:
        return bytes(into[:end]), memoryview(into)[end + 2 : got]
    if got == len(into):
        raise ProtocolError("a reply line longer than 64 KiB")
    return None


def _error(line: bytes, rest: memoryview) -> RedisReplyError:
    """The error of an error reply, whole and alone (else ``ProtocolError``)."""
    if rest.nbytes:
        raise ProtocolError("bytes after an error reply")
    return RedisReplyError(line[1:].decode("utf-8", "replace"))


def _status(line: bytes, rest: memoryview) -> bytes:
    if line[:1] == b"-":
        raise _error(line, rest)
    if line[:1] != b"+" or rest.nbytes:
        raise ProtocolError("expected a status reply")
    return line[1:]


def _set_reply(line: bytes, rest: memoryview) -> bool:
    """A ``SET``'s reply: True when stored, False when Redis refused it for memory
    (``-OOM``: full, ``noeviction``); another error reply raises ``RedisReplyError``."""
    try:
        _status(line, rest)
    except RedisReplyError as exc:
        if exc.code == "OOM":
            return False
        raise
    return True


def _bulk_start(
    line: bytes, rest: memoryview, buffers: ReadBuffers
) -> tuple[memoryview, int, int] | None:
    """A bulk string reply's buffer (a view of one of ``buffers``, for the value and its
    CRLF, ``rest`` copied in first), the value's size and the bytes in it so far; None
    for a nil reply."""
    if line[:1] == b"-":
        raise _error(line, rest)
    if line[:1] != b"$":
        raise ProtocolError("expected a bulk string reply")
    try:
        size = int(line[1:])
    except ValueError:
        raise ProtocolError("a bulk string reply with no length") from None
    if size < 0:
        if rest.nbytes:
            raise ProtocolError("bytes after a nil reply")
        return None
    if rest.nbytes > size + 2:
        raise ProtocolError("bytes after a bulk string reply")
    view = memoryview(buffers.take(size + 2))
    view[: rest.nbytes] = rest
    return view, size, rest.nbytes


def _bulk_value(view: memoryview, size: int) -> memoryview:
    if view[size : size + 2] != _CRLF:
        raise ProtocolError("a bulk string reply without its CRLF")
    return view[:size]
