"""The data port: Get and Put values as raw bytes on a TCP stream, beside the gRPC port.

gRPC moves every value through protobuf messages: built, copied into grpc's
buffers, and reassembled from frames, three user-space copies per value
(docs/benchmarks.md, "Tier data path"). Here a value crosses none: a PUT is
received straight into the ``bytearray`` that the RAM tier then keeps (as a
read-only view; recycled from a dropped value of the same size when the tier
has one, ``kvtier.proto.buffers``), and a GET sends a view of the stored object.

The format is ``kvtier.proto.datawire`` (docs/protocol.md, "Data port"). It
serves the same store with the same rules as ``CacheServicer``: the caller's
tenant from the same ``tenant_of`` (the HELLO preamble carries the
authorization value, checked again on every request so a revoked token stops
working at once), the same limits (``--max-keys``, ``--max-key-bytes``,
``--max-value-bytes``), the same metrics (ops ``DataHello``, ``DataGet``,
``DataPut`` and ``DataInvalid`` for a request whose op cannot be read), TLS
from the same files. A value is stored only once all its bytes arrived; a
connection that stalls for ``--data-timeout`` (idle, or inside a request) is
closed. One task per connection, on the server's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from typing import Protocol

from typing_extensions import Buffer

from kvtier.cacheserver.errors import InvalidRequest, LimitExceeded, RequestError, Unauthenticated
from kvtier.cacheserver.metrics import ServerMetrics
from kvtier.cacheserver.namespace import scoped
from kvtier.cacheserver.servicer import TenantOf
from kvtier.cacheserver.settings import Settings
from kvtier.cacheserver.store import TieredStore
from kvtier.proto import datawire as dw
from kvtier.proto.datawire import Op, Status

logger = logging.getLogger(__name__)

# Large sends go in slices, each with its own --data-timeout: a slow reader that
# still makes progress is not cut, a stalled one is.
SEND_SLICE = 8 << 20
# Values smaller than this are joined with their entry header into one send.
SMALL_VALUE = 64 << 10
_OP_NAMES = {Op.HELLO: "DataHello", Op.GET: "DataGet", Op.PUT: "DataPut"}


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The data port's TLS context, from the same files as the gRPC port's credentials."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if settings.tls_client_ca_file is not None:
        ctx.load_verify_locations(cafile=str(settings.tls_client_ca_file))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class _Closed(Exception):
    """The peer closed the connection."""


class _Lost(RequestError):
    """The stream cannot be parsed any more: answer (if possible) and close."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(str(error))
        self.code = error.code


class _Stream(Protocol):
    async def recv_into(self, view: memoryview) -> int: ...
    async def send(self, data: Buffer) -> None: ...
    def close(self) -> None: ...


class _PlainStream:
    """A non-blocking socket read into and written from the caller's buffers (no copies)."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()

    async def recv_into(self, view: memoryview) -> int:
        """Fills ``view``; returns the bytes that arrived (fewer: the peer closed)."""
        got, n = 0, view.nbytes
        while got < n:
            async with asyncio.timeout(self.timeout_s):
                k = await self.loop.sock_recv_into(self.sock, view[got:])
            if not k:
                break
            got += k
        return got

    async def send(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        for offset in range(0, view.nbytes, SEND_SLICE):
            async with asyncio.timeout(self.timeout_s):
                await self.loop.sock_sendall(self.sock, view[offset : offset + SEND_SLICE])

    def close(self) -> None:
        self.sock.close()


class _TlsStream:
    """A TLS connection through asyncio's streams (decryption copies anyway)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout_s: float
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.timeout_s = timeout_s

    @classmethod
    async def accept(
        cls, sock: socket.socket, context: ssl.SSLContext, timeout_s: float
    ) -> _TlsStream:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        protocol = asyncio.StreamReaderProtocol(reader)
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol, sock, ssl=context, ssl_handshake_timeout=timeout_s
        )
        return cls(reader, asyncio.StreamWriter(transport, protocol, reader, loop), timeout_s)

    async def recv_into(self, view: memoryview) -> int:
        got, n = 0, view.nbytes
        while got < n:
            async with asyncio.timeout(self.timeout_s):
                data = await self.reader.read(min(n - got, 1 << 20))
            if not data:
                break
            view[got : got + len(data)] = data
            got += len(data)
        return got

    async def send(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        for offset in range(0, view.nbytes, 1 << 20):
            self.writer.write(view[offset : offset + (1 << 20)])
            async with asyncio.timeout(self.timeout_s):
                await self.writer.drain()

    def close(self) -> None:
        self.writer.close()


class DataPort:
    """The listener and its connections; ``start()`` binds, ``close(grace)`` stops."""

    def __init__(
        self,
        store: TieredStore,
        settings: Settings,
        metrics: ServerMetrics,
        tenant_of: TenantOf,
        context: ssl.SSLContext | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.tenant_of = tenant_of
        self.context = context
        self.port = 0
        self.closing = False
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: dict[asyncio.Task[None], _Connection] = {}

    async def start(self) -> int:
        host, port = self.settings.host, self.settings.data_port
        try:
            family, _, _, _, address = socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            listener = socket.create_server(address, family=family, backlog=128)
        except OSError as exc:
            raise OSError(
                f"cannot listen on {host}:{port} for the data port (--data-port): {exc}"
            ) from exc
        listener.setblocking(False)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._accepting = asyncio.create_task(self._accept_loop(listener))
        return self.port

    async def close(self, grace_s: float) -> None:
        """Stops accepting, closes idle connections, gives busy ones ``grace_s`` to finish."""
        self.closing = True
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._listener is not None:
            self._listener.close()
        for task, conn in list(self._connections.items()):
            if conn.idle:
                task.cancel()
        tasks = list(self._connections)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(listener)
            except OSError as exc:  # out of file descriptors, ...: back off, keep serving
                logger.warning("data port: accept failed (%s)", exc)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(
                self, f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
            )
            task = asyncio.create_task(conn.serve(sock))
            self._connections[task] = conn
            task.add_done_callback(self._connections.pop)


class _Connection:
    """One client connection: a loop of requests until EOF, an error that loses the stream, or a stall."""

    def __init__(self, port: DataPort, peer: str) -> None:
        self.port = port
        self.settings = port.settings
        self.metrics = port.metrics
        self.peer = peer
        self.idle = True
        self.authorization: str | None = None
        self.stream: _Stream | None = None

    async def serve(self, sock: socket.socket) -> None:
        timeout = self.settings.data_timeout_s
        try:
            if self.port.context is not None:
                try:
                    self.stream = await _TlsStream.accept(sock, self.port.context, timeout)
                except (OSError, ssl.SSLError, TimeoutError) as exc:
                    logger.debug("data port: TLS handshake with %s failed: %s", self.peer, exc)
                    sock.close()
                    return
            else:
                self.stream = _PlainStream(sock, timeout)
            head = bytearray(dw.REQUEST.size)
            while not self.port.closing:
                self.idle = True
                try:
                    got = await self.stream.recv_into(memoryview(head)[:1])
                except TimeoutError:
                    logger.debug("data port: closing %s, idle for %.0fs", self.peer, timeout)
                    return
                if not got:
                    return  # the client closed between requests
                self.idle = False
                if not await self._request(head):
                    return
        except (OSError, _Closed):
            return
        finally:
            if self.stream is not None:
                self.stream.close()
            else:
                sock.close()

    async def _recv(self, view: memoryview) -> None:
        assert self.stream is not None
        if await self.stream.recv_into(view) < view.nbytes:
            raise _Closed

    async def _request(self, head: bytearray) -> bool:
        """Serves one request whose first byte is in ``head``; False: close the connection."""
        assert self.stream is not None
        start = time.perf_counter()
        op_name = "DataInvalid"
        code = Status.OK
        keep = True
        replied = False
        try:
            await self._recv(memoryview(head)[1:])
            magic, version, op, flags, count, table_len = dw.REQUEST.unpack(head)
            if magic != dw.MAGIC:
                raise _Lost(
                    InvalidRequest(
                        "data port request: bad magic (expected b'KVTD'): not a kvtier data-port client"
                    )
                )
            if version != dw.VERSION:
                raise _Lost(
                    InvalidRequest(
                        f"data port request: version {version}; this server speaks {dw.VERSION}"
                    )
                )
            if op not in _OP_NAMES:
                raise _Lost(
                    InvalidRequest(f"data port request: unknown op {op} (1 HELLO, 2 GET, 3 PUT)")
                )
            op_name = _OP_NAMES[Op(op)]
            limit = dw.MAX_HELLO_BYTES if op == Op.HELLO else dw.MAX_TABLE_BYTES
            if table_len > limit:
                raise _Lost(
                    LimitExceeded(f"{op_name}.table_len: {table_len} bytes; at most {limit}")
                )
            table = bytearray(table_len)
            await self._recv(memoryview(table))
            if op == Op.HELLO:
                replied = await self._hello(bytes(table))
            elif op == Op.GET:
                keys = self._get_keys(count, table)
                tenant = self._tenant()
                replied = True  # entries follow the OK reply: a later failure cannot be answered
                await self._get(keys, tenant, bool(flags & dw.FLAG_STOP_AT_FIRST_MISS))
            else:
                items = self._put_items(count, table)
                tenant = self._tenant()
                await self.stream.send(dw.reply(Op.PUT, Status.OK))
                replied = True
                await self._put(items, tenant)
        except RequestError as exc:
            code = Status(exc.code.value[0])
            keep = not isinstance(exc, _Lost | Unauthenticated)
            if not replied:
                with contextlib.suppress(OSError, TimeoutError):
                    await self.stream.send(dw.reply(head[5], code, text=str(exc)))
            if isinstance(exc, _Lost):
                logger.info("data port: closing %s: %s", self.peer, exc)
        except TimeoutError:
            code, keep = Status.DEADLINE_EXCEEDED, False
            logger.info(
                "data port: closing %s, stalled for %.0fs inside a request",
                self.peer,
                self.settings.data_timeout_s,
            )
        except (_Closed, OSError):
            code, keep = Status.CANCELLED, False
        except asyncio.CancelledError:
            code, keep = Status.CANCELLED, False
            raise
        except Exception:
            code, keep = Status.INTERNAL, False
            logger.exception("%s failed", op_name)
            if not replied:
                with contextlib.suppress(OSError, TimeoutError):
                    await self.stream.send(
                        dw.reply(
                            head[5], code, text=f"{op_name}: internal error (see the server log)"
                        )
                    )
        finally:
            self.metrics.requests.labels(op_name, code.name).inc()
            self.metrics.latency.labels(op_name).observe(time.perf_counter() - start)
        return keep

    # -- requests ---------------------------------------------------------------------

    def _tenant(self) -> str:
        md = None if self.authorization is None else [("authorization", self.authorization)]
        return self.port.tenant_of(md)

    async def _hello(self, table: bytes) -> bool:
        try:
            self.authorization = table.decode() if table else None
        except UnicodeDecodeError:
            raise Unauthenticated("DataHello: the authorization value is not UTF-8") from None
        tenant = self._tenant()
        assert self.stream is not None
        await self.stream.send(dw.reply(Op.HELLO, Status.OK, text=tenant))
        return True

    def _check_count(self, field: str, count: int) -> None:
        if count > self.settings.max_keys:
            raise LimitExceeded(
                f"{field}: {count} keys in one call; this server accepts at most "
                f"{self.settings.max_keys} (--max-keys): split the call"
            )

    def _check_key(self, field: str, key: bytes) -> None:
        if not key or len(key) > self.settings.max_key_bytes:
            raise InvalidRequest(
                f"{field}: key of {len(key)} bytes; keys are 1..{self.settings.max_key_bytes} bytes"
            )

    def _get_keys(self, count: int, table: bytearray) -> list[bytes]:
        self._check_count("DataGet.count", count)
        view = memoryview(table)
        keys, pos = [], 0
        for i in range(count):
            if pos + dw.GET_KEY.size > len(view):
                raise InvalidRequest(f"DataGet.table: ends inside key {i} of {count}")
            (n,) = dw.GET_KEY.unpack_from(view, pos)
            pos += dw.GET_KEY.size
            if pos + n > len(view):
                raise InvalidRequest(f"DataGet.table: key {i} runs past the end of the table")
            key = bytes(view[pos : pos + n])
            pos += n
            self._check_key(f"DataGet.keys[{i}]", key)
            keys.append(key)
        if pos != len(view):
            raise InvalidRequest(
                f"DataGet.table: {len(view) - pos} bytes after the last of {count} keys"
            )
        return keys

    def _put_items(self, count: int, table: bytearray) -> list[tuple[bytes, int]]:
        self._check_count("DataPut.count", count)
        view = memoryview(table)
        items, pos = [], 0
        for i in range(count):
            if pos + dw.PUT_ITEM.size > len(view):
                raise InvalidRequest(f"DataPut.table: ends inside value {i} of {count}")
            n, length = dw.PUT_ITEM.unpack_from(view, pos)
            pos += dw.PUT_ITEM.size
            if pos + n > len(view):
                raise InvalidRequest(f"DataPut.table: key {i} runs past the end of the table")
            key = bytes(view[pos : pos + n])
            pos += n
            self._check_key(f"DataPut.keys[{i}]", key)
            if length == 0:
                raise InvalidRequest(f"DataPut.values[{i}].length: must be > 0")
            if length > self.settings.max_value_bytes:
                raise LimitExceeded(
                    f"DataPut.values[{i}].length: value of {length} bytes; this server accepts "
                    f"at most {self.settings.max_value_bytes} (--max-value-bytes)"
                )
            items.append((key, length))
        if pos != len(view):
            raise InvalidRequest(
                f"DataPut.table: {len(view) - pos} bytes after the last of {count} values"
            )
        return items

    async def _get(self, keys: list[bytes], tenant: str, stop_at_first_miss: bool) -> None:
        assert self.stream is not None
        pending = bytearray(dw.reply(Op.GET, Status.OK, count=len(keys)))
        hits = misses = 0
        try:
            for key in keys:
                value = await self.port.store.get(scoped(tenant, key))
                if value is None:
                    misses += 1
                    pending += dw.ENTRY.pack(0, 0)
                    if stop_at_first_miss:
                        break
                    continue
                hits += 1
                view = memoryview(value)
                pending += dw.ENTRY.pack(1, view.nbytes)
                if view.nbytes < SMALL_VALUE:
                    pending += view
                else:
                    await self.stream.send(pending)
                    await self.stream.send(view)
                    pending = bytearray()
                self.metrics.sent_bytes.inc(view.nbytes)
            if pending:
                await self.stream.send(pending)
        finally:
            self.metrics.get_keys.labels("hit").inc(hits)
            self.metrics.get_keys.labels("miss").inc(misses)

    async def _put(self, items: list[tuple[bytes, int]], tenant: str) -> None:
        assert self.stream is not None
        stored = rejected = 0
        for key, length in items:
            buf = self.port.store.receive_buffer(length)
            await self._recv(memoryview(buf))  # a cut here stores nothing of this value
            self.metrics.received_bytes.inc(length)
            if await self.port.store.put(scoped(tenant, key), memoryview(buf).toreadonly()):  # type: ignore[arg-type]
                stored += 1
            else:
                rejected += 1
        await self.stream.send(dw.reply(Op.PUT, Status.OK, count=stored, extra=rejected))
