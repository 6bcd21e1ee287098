"""``DataPortTransport``: Get and Put values as raw bytes over the tier's data port.

The data port (``kvtier.proto.datawire``) has no Lookup, Delete or Stats: those go to
the gRPC transport the data-port transport was given. ``DataPortTransport`` keeps a
few persistent sockets (thread-safe: the connector calls
from several threads; a call takes a socket, or opens one, and gives it back).
A GET value is received straight into a ``bytearray`` of its length: one the
caller gave back (``kvtier.proto.buffers.ReceiveBuffers``, 1 MiB and larger), or a
fresh one; a PUT value is sent from the caller's buffers with ``sendmsg`` (no join). Every
call has a deadline: each socket operation gets the time left.

Errors: ``TransportUnreachable`` when no connection can be opened (the client
may fall back to gRPC); otherwise ``TierUnavailable`` (transport failure, deadline,
a server-side failure) or ``TierRejected`` (the tier refused the call), with
the same status names as the gRPC path. A socket that failed is closed, never
reused. A pooled socket that the tier closed while idle (``--data-timeout``)
is replaced by a new one and the call tried once more (GET and PUT are
idempotent).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from typing_extensions import Buffer

from kvtier.connector.client.codes import code_name, tier_error
from kvtier.connector.client.transport import Items, Transport, TransportUnreachable, Values
from kvtier.connector.errors import TierRejected, TierUnavailable
from kvtier.proto import cache_pb2
from kvtier.proto import datawire as dw
from kvtier.proto.buffers import ReceiveBuffers
from kvtier.proto.datawire import Op, Status

T = TypeVar("T")
MAX_IDLE = 4
CONNECT_TIMEOUT_S = 1.0
_IOV_MAX = 512


def tls_context(
    ca_file: str | None, cert_file: str | None, key_file: str | None
) -> ssl.SSLContext:
    """The TLS context of data-port connections: the gRPC channel's CA and client certificate."""
    context = ssl.create_default_context(cafile=ca_file)
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    return context


class _Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.end = time.monotonic() + timeout_s

    def arm(self, sock: socket.socket) -> None:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline exceeded")
        sock.settimeout(left)


class _Refused(Exception):
    """The tier answered a request with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def recv_into(self, view: memoryview, deadline: _Deadline) -> None:
        got, n = 0, view.nbytes
        while got < n:
            deadline.arm(self.sock)
            k = self.sock.recv_into(view[got:], n - got)
            if not k:
                raise ConnectionError("the tier closed the data connection")
            got += k

    def recv(self, n: int, deadline: _Deadline) -> bytearray:
        buf = bytearray(n)
        self.recv_into(memoryview(buf), deadline)
        return buf

    def send(self, buffers: Sequence[Buffer], deadline: _Deadline) -> None:
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
        if self.tls:  # SSLSocket has no sendmsg
            for v in views:
                deadline.arm(self.sock)
                self.sock.sendall(v)
            return
        while views:
            deadline.arm(self.sock)
            sent = self.sock.sendmsg(views[:_IOV_MAX])
            while views and sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]

    def reply(self, op: Op, deadline: _Deadline) -> tuple[int, int, str]:
        """Reads a reply; returns (count, extra, text), or raises _Refused for an error status."""
        magic, version, _op, status, count, extra, text_len = dw.REPLY.unpack(
            self.recv(dw.REPLY.size, deadline)
        )
        if magic != dw.MAGIC or version != dw.VERSION:
            raise ConnectionError(
                f"not a kvtier data-port reply (magic {magic!r}, version {version})"
            )
        text = self.recv(text_len, deadline).decode(errors="replace") if text_len else ""
        if status != Status.OK:
            raise _Refused(status, text)
        return count, extra, text


class DataPortTransport:
    name = "data"

    def __init__(
        self,
        host: str,
        port: int,
        *,
        control: Transport,
        authorization: str | None,
        context: ssl.SSLContext | None = None,
        max_idle: int = MAX_IDLE,
        buffers: ReceiveBuffers | None = None,
    ) -> None:
        """``control``: the transport of Lookup, Delete and Stats (the client's gRPC one).
        ``authorization``: the HELLO of every new connection ("Bearer <token>")."""
        self.host = host
        self._control = control
        self.buffers = buffers if buffers is not None else ReceiveBuffers(0)
        self.port = port
        self.authorization = authorization
        self.context = context
        self.max_idle = max_idle
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # -- calls ----------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], *, timeout_s: float) -> int:
        return self._control.lookup(keys, timeout_s=timeout_s)

    def delete(self, keys: Sequence[bytes], *, timeout_s: float) -> int:
        return self._control.delete(keys, timeout_s=timeout_s)

    def stats(self, *, timeout_s: float) -> cache_pb2.StatsResponse:
        return self._control.stats(timeout_s=timeout_s)

    def get(self, keys: Sequence[bytes], *, stop_at_first_miss: bool, timeout_s: float) -> Values:
        flags = dw.FLAG_STOP_AT_FIRST_MISS if stop_at_first_miss else 0
        table = dw.get_table(list(keys))
        request = dw.request(Op.GET, len(keys), len(table), flags)

        def call(conn: _Conn, deadline: _Deadline) -> Values:
            conn.send([request, table], deadline)
            count, _, _ = conn.reply(Op.GET, deadline)
            out: Values = []
            for _ in range(count):
                found, n = dw.ENTRY.unpack(conn.recv(dw.ENTRY.size, deadline))
                if not found:
                    out.append(None)
                    if stop_at_first_miss:
                        break
                    continue
                buf = self.buffers.take(n)
                conn.recv_into(memoryview(buf), deadline)  # whole, or the call fails
                out.append(memoryview(buf).toreadonly())
            return out

        return self._call("Get", call, timeout_s)

    def put(self, items: Items, *, timeout_s: float) -> int:
        lengths = [(key, sum(memoryview(p).nbytes for p in parts)) for key, parts in items]
        table = dw.put_table(lengths)
        request = dw.request(Op.PUT, len(items), len(table))
        values = [p for _, parts in items for p in parts]

        def call(conn: _Conn, deadline: _Deadline) -> int:
            conn.send([request, table], deadline)
            conn.reply(Op.PUT, deadline)  # the tier accepts the keys and sizes: send the bytes
            conn.send(values, deadline)
            stored, _, _ = conn.reply(Op.PUT, deadline)
            return stored

        return self._call("Put", call, timeout_s)

    # -- connections ----------------------------------------------------------------

    def _call(self, op: str, fn: Callable[[_Conn, _Deadline], T], timeout_s: float) -> T:
        deadline = _Deadline(timeout_s)
        for attempt in (0, 1):
            conn, reused = self._acquire(deadline)
            try:
                result = fn(conn, deadline)
            except _Refused as exc:
                conn.close()  # the tier may close after an error: never reuse
                raise tier_error(op, code_name(exc.status), str(exc)) from exc
            except TimeoutError as exc:
                conn.close()
                raise TierUnavailable(
                    f"{op}: DEADLINE_EXCEEDED: no answer from the data port within {timeout_s:g}s"
                ) from exc
            except (OSError, ConnectionError) as exc:
                conn.close()
                if reused and attempt == 0:
                    continue  # the tier closed this idle socket: once more on a new one
                raise TierUnavailable(
                    f"{op}: UNAVAILABLE: data port {self.host}:{self.port}: {exc}"
                ) from exc
            except BaseException:
                conn.close()
                raise
            self._release(conn)
            return result
        raise AssertionError("unreachable")

    def _acquire(self, deadline: _Deadline) -> tuple[_Conn, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(deadline), False

    def _release(self, conn: _Conn) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def _connect(self, deadline: _Deadline) -> _Conn:
        left = max(0.001, min(CONNECT_TIMEOUT_S, deadline.end - time.monotonic()))
        try:
            sock = socket.create_connection((self.host, self.port), timeout=left)
        except OSError as exc:
            raise TransportUnreachable(
                f"cannot connect to the data port {self.host}:{self.port}: {exc}"
            ) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.context is not None:
                sock = self.context.wrap_socket(sock, server_hostname=self.host)
            conn = _Conn(sock)
            auth = (self.authorization or "").encode()
            conn.send([dw.request(Op.HELLO, 0, len(auth)), auth], deadline)
            conn.reply(Op.HELLO, deadline)
        except _Refused as exc:
            sock.close()
            raise TierRejected(
                f"DataHello: {code_name(exc.status)}: {exc}", code_name(exc.status)
            ) from exc
        except OSError as exc:  # TLS failures, resets, timeouts
            sock.close()
            raise TransportUnreachable(f"data port {self.host}:{self.port}: {exc}") from exc
        return conn
