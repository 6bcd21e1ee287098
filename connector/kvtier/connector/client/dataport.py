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
the same status names as the gRPC path (``kvtier.connector.client.pool``: the
connections and the error mapping both socket transports share).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Sequence

from typing_extensions import Buffer

from kvtier.connector.client.codes import code_name
from kvtier.connector.client.pool import MAX_IDLE, ConnectionPool, Deadline, Refused
from kvtier.connector.client.transport import Items, Transport, TransportUnreachable, Values
from kvtier.connector.errors import TierRejected
from kvtier.proto import cache_pb2
from kvtier.proto import datawire as dw
from kvtier.proto.buffers import ReceiveBuffers
from kvtier.proto.datawire import Op, Status

_IOV_MAX = 512


def tls_context(
    ca_file: str | None, cert_file: str | None, key_file: str | None
) -> ssl.SSLContext:
    """The TLS context of data-port connections: the gRPC channel's CA and client certificate."""
    context = ssl.create_default_context(cafile=ca_file)
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    return context


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def recv_into(self, view: memoryview, deadline: Deadline) -> None:
        got, n = 0, view.nbytes
        while got < n:
            deadline.arm(self.sock)
            k = self.sock.recv_into(view[got:], n - got)
            if not k:
                raise ConnectionError("the tier closed the data connection")
            got += k

    def recv(self, n: int, deadline: Deadline) -> bytearray:
        buf = bytearray(n)
        self.recv_into(memoryview(buf), deadline)
        return buf

    def send(self, buffers: Sequence[Buffer], deadline: Deadline) -> None:
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

    def reply(self, op: Op, deadline: Deadline) -> tuple[int, int, str]:
        """Reads a reply; returns (count, extra, text), or raises Refused for an error status."""
        magic, version, _op, status, count, extra, text_len = dw.REPLY.unpack(
            self.recv(dw.REPLY.size, deadline)
        )
        if magic != dw.MAGIC or version != dw.VERSION:
            raise ConnectionError(
                f"not a kvtier data-port reply (magic {magic!r}, version {version})"
            )
        text = self.recv(text_len, deadline).decode(errors="replace") if text_len else ""
        if status != Status.OK:
            raise Refused(status, text)
        return count, extra, text


class DataPortTransport(ConnectionPool[_Conn]):
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
        super().__init__(max_idle)
        self.host = host
        self._control = control
        self.buffers = buffers if buffers is not None else ReceiveBuffers(0)
        self.port = port
        self.where = f"data port {host}:{port}"
        self.authorization = authorization
        self.context = context

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

        def call(conn: _Conn, deadline: Deadline) -> Values:
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

        def call(conn: _Conn, deadline: Deadline) -> int:
            conn.send([request, table], deadline)
            conn.reply(Op.PUT, deadline)  # the tier accepts the keys and sizes: send the bytes
            conn.send(values, deadline)
            stored, _, _ = conn.reply(Op.PUT, deadline)
            return stored

        return self._call("Put", call, timeout_s)

    # -- connections ----------------------------------------------------------------

    def _connect(self, deadline: Deadline) -> _Conn:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=deadline.connect_timeout())
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
        except Refused as exc:
            sock.close()
            raise TierRejected(
                f"DataHello: {code_name(exc.status)}: {exc}", code_name(exc.status)
            ) from exc
        except OSError as exc:  # TLS failures, resets, timeouts
            sock.close()
            raise TransportUnreachable(f"data port {self.host}:{self.port}: {exc}") from exc
        return conn
