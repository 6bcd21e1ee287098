"""One data-port connection: the data port's request codec over one byte stream.

It reads requests (``kvtier.proto.datawire``), turns them into calls on the
``RequestCore`` (tenants, limits, the store, metrics) and writes the replies;
``STATUSES`` maps the core's errors to status numbers (gRPC's), the one place
the data port does. The listener that accepts connections is
``kvtier.cacheserver.dataport``; the byte streams (plain or TLS) are
``kvtier.cacheserver.datastreams``.

Deadlines: a connection idle for ``--data-timeout`` is closed; a request's
header and table must arrive whole within ``--data-timeout`` of its first
byte (a peer that dribbles them is cut); a value must keep arriving (each
receive step within ``--data-timeout``). Memory: nothing a header declares is
allocated before the caller's token is checked; a table is bounded by its
count of keys and reserved from ``--incoming-bytes``, and so is each value
while it arrives (the first before the OK reply).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import TypeVar

from kvtier.cacheserver.core import RequestCore
from kvtier.cacheserver.datastreams import DataStream, PlainStream, TlsStream
from kvtier.cacheserver.errors import (
    InvalidRequest,
    LimitExceeded,
    Overloaded,
    RequestError,
    Unauthenticated,
)
from kvtier.proto import datawire as dw
from kvtier.proto.datawire import Op, Status

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Values smaller than this are joined with their entry header into one send, and
# such sends are gathered up to GATHER_BYTES (never more: a Get naming one small
# value thousands of times must not build a reply of thousands of copies).
SMALL_VALUE = 64 << 10
GATHER_BYTES = 256 << 10
# The longest key a table can carry (its length is a u16).
MAX_WIRE_KEY = 0xFFFF
# Bytes a refused request still sends (its table, its values) are read into this and dropped.
DISCARD_BYTES = 64 << 10
_OP_NAMES = {Op.HELLO: "DataHello", Op.GET: "DataGet", Op.PUT: "DataPut"}

STATUSES: dict[type[RequestError], Status] = {
    InvalidRequest: Status.INVALID_ARGUMENT,
    LimitExceeded: Status.RESOURCE_EXHAUSTED,
    Unauthenticated: Status.UNAUTHENTICATED,
    Overloaded: Status.UNAVAILABLE,
}


def status_of(error: RequestError) -> Status:
    """The data-port status a refused request is answered with (gRPC's numbers)."""
    for cls in type(error).__mro__:
        status = STATUSES.get(cls)
        if status is not None:
            return status
    return Status.INVALID_ARGUMENT


class _Closed(Exception):
    """The peer closed the connection."""


class _Lost(Exception):
    """The stream cannot be parsed any more: answer ``error`` (if possible) and close."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(str(error))
        self.error = error


class DataConnection:
    """One client connection: a loop of requests until EOF, an error that loses the stream, or a stall."""

    def __init__(
        self,
        core: RequestCore,
        context: ssl.SSLContext | None,
        peer: str,
        closing: Callable[[], bool],
    ) -> None:
        self.core = core
        self.context = context
        self.closing = closing
        self.timeout_s = core.settings.data_timeout_s
        self.peer = peer
        self.idle = True
        self.authorization: str | None = None
        self.stream: DataStream | None = None
        self.replied = False  # whether the request being served was answered (OK) already
        self.deadline = 0.0  # loop time by which its header and table must have arrived

    async def serve(self, sock: socket.socket) -> None:
        try:
            if self.context is not None:
                try:
                    self.stream = await TlsStream.accept(sock, self.context, self.timeout_s)
                except (OSError, ssl.SSLError, TimeoutError) as exc:
                    logger.debug("data port: TLS handshake with %s failed: %s", self.peer, exc)
                    sock.close()
                    return
            else:
                self.stream = PlainStream(sock, self.timeout_s)
            head = bytearray(dw.REQUEST.size)
            while not self.closing():
                self.idle = True
                try:
                    got = await self.stream.recv_into(memoryview(head)[:1])
                except TimeoutError:
                    logger.debug("data port: closing %s, idle for %.0fs", self.peer, self.timeout_s)
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

    async def _refuse(self, op: int, error: RequestError) -> Status:
        """Answers a refused request with its status and message; returns the status."""
        assert self.stream is not None
        status = status_of(error)
        with contextlib.suppress(OSError, TimeoutError):
            await self.stream.send(dw.reply(op, status, text=str(error)))
        return status

    async def _discard(self, n: int, *, whole: bool = False) -> None:
        """Reads and drops ``n`` bytes (what a refused request still sends), holding none of them;
        ``whole``: within the request's deadline (a table), not per step (values)."""
        scratch = memoryview(bytearray(min(n, DISCARD_BYTES)))
        while n:
            k = min(n, scratch.nbytes)
            await (self._recv_whole(scratch[:k]) if whole else self._recv(scratch[:k]))
            n -= k

    async def _recv_whole(self, view: memoryview) -> None:
        """Receives part of a request's header or table: all of them must arrive within
        ``--data-timeout`` of the request's first byte (a peer that dribbles them is cut)."""
        async with asyncio.timeout_at(self.deadline):
            await self._recv(view)

    async def _request(self, head: bytearray) -> bool:
        """Serves one request whose first byte is in ``head``; False: close the connection."""
        assert self.stream is not None
        start = time.perf_counter()
        op_name = "DataInvalid"
        code = Status.OK
        keep = True
        self.replied = False
        self.deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            await self._recv_whole(memoryview(head)[1:])
            op, flags, count, table_len = _header(head)
            op_name = _OP_NAMES[op]
            if op == Op.HELLO:
                if table_len > dw.MAX_HELLO_BYTES:
                    raise _Lost(
                        LimitExceeded(
                            f"DataHello.table_len: {table_len} bytes; at most {dw.MAX_HELLO_BYTES}"
                        )
                    )
                table = bytearray(table_len)
                await self._recv_whole(memoryview(table))
                await self._hello(bytes(table))
            else:
                # The caller first: nothing a header declares is allocated for an unknown caller.
                tenant = self.core.tenant(self.authorization)
                if op == Op.GET:
                    keys = await self._table(op_name, count, table_len, dw.GET_KEY.size, self._get_keys)
                    self.replied = True  # entries follow the OK reply: a later failure cannot be answered
                    await self._get(keys, tenant, bool(flags & dw.FLAG_STOP_AT_FIRST_MISS))
                else:
                    items = await self._table(
                        op_name, count, table_len, dw.PUT_ITEM.size, self._put_items
                    )
                    await self._put(items, tenant)
        except _Lost as lost:
            code, keep = await self._refuse(head[5], lost.error), False
            logger.info("data port: closing %s: %s", self.peer, lost)
        except RequestError as exc:
            keep = not isinstance(exc, Unauthenticated)
            code = status_of(exc) if self.replied else await self._refuse(head[5], exc)
        except TimeoutError:
            code, keep = Status.DEADLINE_EXCEEDED, False
            logger.info(
                "data port: closing %s, stalled for %.0fs inside a request", self.peer, self.timeout_s
            )
        except (_Closed, OSError):
            code, keep = Status.CANCELLED, False
        except asyncio.CancelledError:
            code, keep = Status.CANCELLED, False
            raise
        except Exception:
            code, keep = Status.INTERNAL, False
            logger.exception("%s failed", op_name)
            if not self.replied:
                with contextlib.suppress(OSError, TimeoutError):
                    await self.stream.send(
                        dw.reply(head[5], code, text=f"{op_name}: internal error (see the server log)")
                    )
        finally:
            self.core.answered(op_name, code.name, start)
        return keep

    async def _table(
        self,
        op_name: str,
        count: int,
        table_len: int,
        entry_size: int,
        parse: Callable[[int, bytearray], T],
    ) -> T:
        """Reads and parses a GET or PUT table, refusing what it cannot hold before allocating
        it: an oversized table closes the connection, too many keys or a full budget drop it."""
        if table_len > dw.MAX_TABLE_BYTES:
            raise _Lost(
                LimitExceeded(f"{op_name}.table_len: {table_len} bytes; at most {dw.MAX_TABLE_BYTES}")
            )
        try:
            self.core.check_count(f"{op_name}.count", count)
        except LimitExceeded:
            await self._discard(table_len, whole=True)
            raise
        bound = count * (entry_size + MAX_WIRE_KEY)  # oversized keys still get their own error
        if table_len > bound:
            raise _Lost(
                LimitExceeded(f"{op_name}.table_len: {table_len} bytes; {count} keys take at most {bound}")
            )
        try:
            held = self.core.reserve(f"{op_name}.table_len", table_len)
        except Overloaded:
            await self._discard(table_len, whole=True)
            raise
        with held:
            table = bytearray(table_len)
            await self._recv_whole(memoryview(table))
            return parse(count, table)

    # -- requests ---------------------------------------------------------------------

    async def _hello(self, table: bytes) -> None:
        try:
            self.authorization = table.decode() if table else None
        except UnicodeDecodeError:
            raise Unauthenticated("DataHello: the authorization value is not UTF-8") from None
        tenant = self.core.tenant(self.authorization)
        assert self.stream is not None
        self.replied = True
        await self.stream.send(dw.reply(Op.HELLO, Status.OK, text=tenant))

    def _get_keys(self, count: int, table: bytearray) -> list[bytes]:
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
            self.core.check_key(f"DataGet.keys[{i}]", key)
            keys.append(key)
        if pos != len(view):
            raise InvalidRequest(f"DataGet.table: {len(view) - pos} bytes after the last of {count} keys")
        return keys

    def _put_items(self, count: int, table: bytearray) -> list[tuple[bytes, int]]:
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
            self.core.check_key(f"DataPut.keys[{i}]", key)
            self.core.check_value_length(f"DataPut.values[{i}].length", length)
            items.append((key, length))
        if pos != len(view):
            raise InvalidRequest(f"DataPut.table: {len(view) - pos} bytes after the last of {count} values")
        return items

    async def _get(self, keys: list[bytes], tenant: str, stop_at_first_miss: bool) -> None:
        assert self.stream is not None
        pending = bytearray(dw.reply(Op.GET, Status.OK, count=len(keys)))
        values = self.core.get(tenant, keys, stop_at_first_miss)
        async with contextlib.aclosing(values):
            async for _, value in values:
                if value is None:
                    pending += dw.ENTRY.pack(0, 0)
                    continue
                view = memoryview(value)
                pending += dw.ENTRY.pack(1, view.nbytes)
                if view.nbytes < SMALL_VALUE:
                    pending += view
                else:
                    await self.stream.send(pending)
                    await self.stream.send(view)
                    pending = bytearray()
                if len(pending) >= GATHER_BYTES:
                    await self.stream.send(pending)
                    pending = bytearray()
        if pending:
            await self.stream.send(pending)

    async def _put(self, items: list[tuple[bytes, int]], tenant: str) -> None:
        """Receives and stores a PUT's values. Each value holds its length of the budget while
        it arrives: the first is reserved before the OK reply (a full budget is refused before
        any value byte is sent); a later one that does not fit is read and dropped with every
        value after it, and the final reply says UNAVAILABLE (the values before it stay)."""
        assert self.stream is not None
        held = self.core.reserve("DataPut.values[0].length", items[0][1]) if items else None
        stored = rejected = 0
        refused: Overloaded | None = None
        try:
            await self.stream.send(dw.reply(Op.PUT, Status.OK))
            self.replied = True
            for i, (key, length) in enumerate(items):
                if refused is None and held is None:
                    try:
                        held = self.core.reserve(f"DataPut.values[{i}].length", length)
                    except Overloaded as exc:
                        refused = exc
                if refused is not None:
                    await self._discard(length)
                    continue
                buf = self.core.receive_buffer(length, tenant)
                await self._recv(memoryview(buf))  # a cut here stores nothing of this value
                if await self.core.store_value(tenant, key, memoryview(buf).toreadonly()):
                    stored += 1
                else:
                    rejected += 1
                if held is not None:
                    held.release()
                    held = None
        finally:
            if held is not None:
                held.release()
        status, text = (Status.OK, "") if refused is None else (status_of(refused), str(refused))
        await self.stream.send(dw.reply(Op.PUT, status, count=stored, extra=rejected, text=text))
        if refused is not None:
            raise refused


def _header(head: bytearray) -> tuple[Op, int, int, int]:
    """A request header's op, flags, count and table length; raises _Lost when the stream is unusable."""
    magic, version, op, flags, count, table_len = dw.REQUEST.unpack(head)
    if magic != dw.MAGIC:
        raise _Lost(
            InvalidRequest(
                "data port request: bad magic (expected b'KVTD'): not a kvtier data-port client"
            )
        )
    if version != dw.VERSION:
        raise _Lost(
            InvalidRequest(f"data port request: version {version}; this server speaks {dw.VERSION}")
        )
    if op not in _OP_NAMES:
        raise _Lost(InvalidRequest(f"data port request: unknown op {op} (1 HELLO, 2 GET, 3 PUT)"))
    return Op(op), flags, count, table_len
