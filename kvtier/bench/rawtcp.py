"""The ceiling of ``kvtier bench tier``: a raw put/get-bytes server and client over TCP.

The least a network key-value store can do in Python: one thread per
connection, a fixed binary header, values kept as they arrived. The server
receives a value straight into a buffer it then keeps, and sends a stored
value with one ``sendall``; the client sends its buffers with ``sendmsg`` and
receives into a buffer. Both ends receive into memory already mapped when they
have some of that size: the server into the buffer of a value the PUT replaced,
the client into the buffers of values its caller gave back (``recycle``), as
kvtier's do (a fresh buffer of megabytes costs page faults and zeroing). No
framing, no checksums, no tiers, no checks that a buffer is still in use: what
any store on top of TCP pays at least.

Wire (all integers little-endian)::

    request   op:u8 ('P' put, 'G' get)  key_len:u16  value_len:u64  key  [value]
    put reply status:u8 (1 stored)
    get reply found:u8  value_len:u64  [value]

Run the server: ``python -m bench.rawtcp HOST PORT`` (prints "ready" once it listens).
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
from collections.abc import Sequence

from typing_extensions import Buffer

_REQ = struct.Struct("<cHQ")
_GET_REPLY = struct.Struct("<BQ")


class _Spares:
    """Buffers to receive into again, by size (thread-safe)."""

    def __init__(self) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self._lock = threading.Lock()

    def take(self, n: int) -> bytearray:
        with self._lock:
            free = self._free.get(n)
            if free:
                return free.pop()
        return bytearray(n)

    def give(self, buf: bytearray) -> None:
        with self._lock:
            self._free.setdefault(len(buf), []).append(buf)


def recv_exact(sock: socket.socket, n: int, spares: _Spares | None = None) -> bytearray:
    buf = spares.take(n) if spares is not None else bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


def _serve_connection(conn: socket.socket, store: dict[bytes, bytearray], spares: _Spares) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                head = recv_exact(conn, _REQ.size)
            except ConnectionError:
                return
            op, key_len, value_len = _REQ.unpack(head)
            key = bytes(recv_exact(conn, key_len))
            if op == b"P":
                old = store.get(key)
                store[key] = recv_exact(conn, value_len, spares)
                if old is not None:
                    spares.give(old)
                conn.sendall(b"\x01")
            elif op == b"G":
                value = store.get(key)
                if value is None:
                    conn.sendall(_GET_REPLY.pack(0, 0))
                else:
                    conn.sendmsg([_GET_REPLY.pack(1, len(value)), value])
            else:
                return


def serve(host: str, port: int) -> None:
    store: dict[bytes, bytearray] = {}
    spares = _Spares()
    with socket.create_server((host, port)) as listener:
        print("ready", flush=True)
        while True:
            conn, _ = listener.accept()
            args = (conn, store, spares)
            threading.Thread(target=_serve_connection, args=args, daemon=True).start()


class RawClient:
    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.spares = _Spares()

    def put(self, items: Sequence[tuple[bytes, Buffer]]) -> int:
        for key, value in items:
            n = memoryview(value).nbytes
            _sendmsg_all(self.sock, [_REQ.pack(b"P", len(key), n) + key, value])
        for _ in items:  # replies of a batch are read after it is sent (pipelined)
            recv_exact(self.sock, 1)
        return len(items)

    def get(self, keys: Sequence[bytes]) -> list[bytearray | None]:
        for key in keys:
            self.sock.sendall(_REQ.pack(b"G", len(key), 0) + key)
        out: list[bytearray | None] = []
        for _ in keys:
            found, n = _GET_REPLY.unpack(recv_exact(self.sock, _GET_REPLY.size))
            out.append(recv_exact(self.sock, n, self.spares) if found else None)
        return out

    def recycle(self, values: list[bytearray | None]) -> None:
        """The caller is done with these values: later GETs receive into them."""
        for value in values:
            if value is not None:
                self.spares.give(value)
        values.clear()

    def close(self) -> None:
        self.sock.close()


def _sendmsg_all(sock: socket.socket, buffers: list[Buffer]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
