"""The Redis tier's own client for values: ``GET`` and ``SET`` of records, on blocking
sockets in worker threads, with no copy of a value in Python.

redis-py's asyncio client copies a ``SET``'s value three times in Python (the record's
``head + value``, ``writelines``' join, the transport's buffer) and takes a ``GET``
reply in 64 KiB pieces that it joins: for values of megabytes that, not Redis, was the
Redis tier's cost (docs/benchmarks.md, "Redis tier against redis-py, disk tier against
plain files"). Here a ``SET`` is one ``sendmsg`` of the command's head, the record's
header and the value's own memory (the kernel copies it once, into the socket); a
``GET`` reply is received straight into a buffer of ``ReadBuffers``, reused once
nothing holds the value read into it. ``socket.sendmsg`` and ``recv_into`` release the
GIL, so a transfer runs beside the event loop, on the other core.

Only standalone servers over TCP or a unix socket without TLS use it (``RedisTier``
picks it: every ``GET``, and ``SET`` of records from ``BULK_SET_MIN``, 4 MiB, up, or
from 1 MiB while another ``SET`` is in flight; a smaller ``SET`` on an idle tier costs
less in redis-py than the hop to a worker thread); the rest of
the tier's commands (``EXISTS``, ``DEL``, ``INFO``, the quota ledger's scripts) stay on
redis-py, as do Cluster and TLS.

Connections: a pool of idle ones; a call takes one (or connects: ``AUTH`` when there is
a password, ``SELECT`` when the database is not 0, ``CLIENT SETNAME kvtier``) and gives
it back after a whole reply. A call, the connecting and the whole value's transfer
included, is bounded by ``timeout_s``: each socket step waits at most that long, and no
step starts once the call has taken that long (at most about twice it in all). A
connection that failed in any way, or timed out, is closed, never reused: it may hold
half a reply. A call that fails with a broken connection taken from the pool (a
restarted server leaves stale ones) closes every idle connection and is tried once more
on a new one, as redis-py's retry does; a timeout is not retried. Every failure is an
``OSError`` (``ConnectionError``, ``TimeoutError``) but a whole error reply from Redis,
``RedisReplyError``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

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


class BulkClient:
    """``GET`` and ``SET`` of one Redis server (blocking: call from worker threads)."""

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
        buffers: ReadBuffers | None = None,
        client_name: str = "kvtier",
    ) -> None:
        if (host is None) == (path is None):
            raise ValueError("BulkClient needs a host (TCP) or a path (unix socket)")
        self.host, self.port, self.path = host, port, path
        self.timeout_s = timeout_s
        self.buffers = buffers if buffers is not None else ReadBuffers()
        self._hello = _handshake(username, password, db, client_name)
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_url_kwargs(cls, kwargs: dict[str, Any], timeout_s: float) -> BulkClient:
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
        return cls(
            host=kwargs.get("host") or "localhost", port=int(kwargs.get("port") or 6379), **common
        )

    # --- commands --------------------------------------------------------------------

    def get(self, name: bytes) -> memoryview | None:
        """The value of ``name`` (a view of a buffer of ``buffers``), None when unset."""
        return self._call([_command(b"GET", name)], _read_bulk)

    def set(self, name: bytes, parts: tuple[Buffer, ...], ex: int = 0) -> bool:
        """``SET name <parts joined>`` (``EX ex`` when ``ex``), sent from the parts' own
        memory. False when Redis refuses it for memory (``-OOM``: full, ``noeviction``)."""
        size = sum(memoryview(p).nbytes for p in parts)
        args = 5 if ex else 3
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (args, len(name), name, size)
        seconds = str(ex).encode()
        tail = b"\r\n$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(seconds), seconds) if ex else _CRLF
        try:
            self._call([head, *parts, tail], _read_status)
        except RedisReplyError as exc:
            if exc.code == "OOM":
                return False
            raise
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True  # connections given back from now on are closed
        self._drop_idle()

    # --- connections -----------------------------------------------------------------

    def _call(
        self, request: list[Buffer], read: Callable[[socket.socket, ReadBuffers, float], T]
    ) -> T:
        for attempt in (0, 1):
            deadline = time.monotonic() + self.timeout_s
            sock = self._idle_socket(reuse=attempt == 0)
            reused = sock is not None
            if sock is None:
                sock = self._connect(deadline)
            try:
                sock.settimeout(self.timeout_s)
                _send_all(sock, request, deadline)
                reply = read(sock, self.buffers, deadline)
            except RedisReplyError:
                self._give_back(sock)  # a whole error reply: the connection is fine
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
                    _read_status(sock, self.buffers, deadline)
                except RedisReplyError as exc:
                    raise SetupRefused(f"Redis refused {what} ({exc.code})") from None
        except BaseException:
            sock.close()
            raise
        return sock


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
        sent = sock.sendmsg(views[:512])  # (IOV_MAX is 1024)
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
        end = into.find(_CRLF, 0, got)
        if end >= 0:
            return bytes(into[:end]), view[end + 2 : got]
        if got == len(into):
            raise ProtocolError("a reply line longer than 64 KiB")


def _error(line: bytes) -> RedisReplyError:
    return RedisReplyError(line[1:].decode("utf-8", "replace"))


def _read_status(sock: socket.socket, buffers: ReadBuffers, deadline: float) -> bytes:
    line, rest = _read_line(sock, bytearray(_HEAD_BYTES), deadline)
    if line[:1] == b"-":
        raise _error(line)
    if line[:1] != b"+" or rest.nbytes:
        raise ProtocolError("expected a status reply")
    return line[1:]


def _read_bulk(sock: socket.socket, buffers: ReadBuffers, deadline: float) -> memoryview | None:
    line, rest = _read_line(sock, bytearray(_HEAD_BYTES), deadline)
    if line[:1] == b"-":
        raise _error(line)
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
    whole = size + 2  # the value, then CRLF
    if rest.nbytes > whole:
        raise ProtocolError("bytes after a bulk string reply")
    buf = buffers.take(whole)
    view = memoryview(buf)
    view[: rest.nbytes] = rest
    got = rest.nbytes
    while got < whole:
        _check(deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ClosedByServer("Redis closed the connection mid-reply")
        got += n
    if view[size:whole] != _CRLF:
        raise ProtocolError("a bulk string reply without its CRLF")
    return view[:size]
