"""One client of the same-node socket: its requests, its lease, its staging segment.

A connection (``LocalConnection``, started by ``kvtier.cacheserver.localport``) reads
requests (``kvtier.proto.localwire``) until EOF, a stream it cannot parse, a stall of
``--data-timeout`` inside a request or idle, or a lease older than ``--data-timeout``.

- A GET's values in the tier's segments are *leased* to the connection: it keeps views
  of them (so their memory is not reused, ``kvtier.cacheserver.arena``) until RELEASE,
  its next GET, its end, or the lease's age passing ``--data-timeout``. At the end the
  connection is shut down *first* and the lease dropped after, so a client that finds
  its connection open after copying knows its copy was whole.
- A GET from a client that reads record files itself (``FLAG_FILES``) answers a
  disk-tier hit with the record's file, opened read-only, its header checked: the fd
  rides on the reply (``SCM_RIGHTS``) and the client reads and checks key and value
  itself; the tier never reads the value. Record files are never rewritten in place
  (written aside, renamed), so no lease is needed: a file replaced or removed meanwhile
  stays readable through the descriptor, whole. At most ``MAX_FDS`` files per reply, and
  none while the client has not read everything sent to it before (values then go
  inline): descriptors in flight count against the tier's own limit.
- A RESERVE takes extents for the values of the next PUT in the tenant's own segments
  (``SharedArena.take(tenant, writable=True)``), whose read-write descriptors go with the reply;
  the client writes each value into its extent, hashing it as it copies, and PUT with
  ``FLAG_RESERVED`` stores the extent itself with the checksum the client sent: one copy
  in all, and the tier does not read the value to store it. A connection holds one
  RESERVE's extents (counted against ``--incoming-bytes``) until they are stored, the
  next RESERVE, a HELLO, or its end; when the tier ends a connection (a timeout, a
  stream it cannot parse, shutdown) the extents it had not stored are kept out of reuse
  for ``--data-timeout`` more (its client may still be copying into one, and another
  connection of its tenant must not get it meanwhile).

  Trust: the tier records the writer's checksum without re-reading the value. Memory a
  tenant's clients can write stays writable by them after any check the tier could make
  (``kvtier.cacheserver.arena``: it only ever holds that tenant's values), so a check at
  store time would prove nothing later; every same-node reader checks the checksum as it
  copies and fails its Get on a mismatch (never returns the bytes). A value whose writer
  lied about it, or changed it after storing it, is that tenant's own, as a wrong value
  it sent over TCP would be.
- A PUT from the staging segment (STAGE; when a RESERVE found no room) copies values
  into the tier's own memory and checks each one's checksum on what it copied; a value only the disk
  tier will hold (larger than the RAM tier takes, written through) is written from the
  staging segment to its record file in one pass, checked as written
  (``Store.put_checked``).
- Every request passes the request core (``kvtier.cacheserver.core``): the HELLO's
  authorization value, checked again on every request; limits; the store; metrics (ops
  ``LocalHello``, ``LocalLookup``, ``LocalGet``, ``LocalPut``, ``LocalDelete``,
  ``LocalStats``, ``LocalStage``, ``LocalInvalid``; RELEASE is part of a Get and not
  counted). Status numbers are the data port's (``kvtier.cacheserver.dataport.status_of``).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import termios
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from typing_extensions import Buffer

from kvtier.cacheserver import record
from kvtier.cacheserver.arena import SEALS, Segment, sealed_memfd
from kvtier.cacheserver.budget import Reservation
from kvtier.cacheserver.dataport import status_of
from kvtier.cacheserver.datastreams import PlainStream
from kvtier.cacheserver.errors import (
    ChecksumMismatch,
    InvalidRequest,
    LimitExceeded,
    Overloaded,
    RequestError,
    Unauthenticated,
)
from kvtier.cacheserver.localtables import Lost, parse_keys, parse_put_items
from kvtier.cacheserver.record import RecordFile
from kvtier.cacheserver.servicer import _stats_response
from kvtier.proto import localwire as lw
from kvtier.proto.localwire import Op, Place, Status

if TYPE_CHECKING:
    from kvtier.cacheserver.localport import LocalPort

logger = logging.getLogger(__name__)

DISCARD_BYTES = 64 << 10
_OP_NAMES = {
    Op.HELLO: "LocalHello",
    Op.LOOKUP: "LocalLookup",
    Op.GET: "LocalGet",
    Op.PUT: "LocalPut",
    Op.DELETE: "LocalDelete",
    Op.STATS: "LocalStats",
    Op.STAGE: "LocalStage",
    Op.RELEASE: "LocalRelease",
    Op.RESERVE: "LocalReserve",
}


class _Closed(Exception):
    """The peer closed the connection."""


class _Staging:
    """A connection's staging segment: a writable memfd the client fills, sealed against
    a change of size (a client that shrank it would make the tier's reads fault)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd, self.map = sealed_memfd("kvtier-staging", size, SEALS)
        self.view = memoryview(self.map)

    def close_fd(self) -> None:
        """Closes the tier's descriptor (once: its number may belong to another file after)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        self.close_fd()
        with contextlib.suppress(BufferError):
            self.view.release()
            self.map.close()


class LocalConnection:
    """One client: requests until EOF, a stream that cannot be parsed, a stall, or a lease timeout."""

    def __init__(self, port: LocalPort, sock: socket.socket) -> None:
        self.port = port
        self.core = port.core
        self.arena = port.arena
        self.sock = sock
        self.timeout_s = port.core.settings.data_timeout_s
        self.stream = PlainStream(sock, self.timeout_s)
        self.idle = True
        self.authorization: str | None = None
        self.segments: set[int] = set()  # segments whose fds this client has
        self.lease: list[memoryview] = []
        self.leased: set[int] = set()  # ids of the leased values' extents
        self.lease_bytes = 0
        self.lease_since = 0.0
        self.staging: _Staging | None = None
        self.staging_held: Reservation | None = None
        self.writable: set[int] = set()  # segments whose read-write fds this client has
        self.reserved: dict[int, memoryview] = {}  # the last RESERVE's extents, by index
        self.reserved_tenant = ""
        self.reserved_held: Reservation | None = None
        self.peer_closed = False

    async def serve(self) -> None:
        head = bytearray(lw.REQUEST.size)
        try:
            while not self.port.closing:
                self.idle = True
                wait = self.timeout_s
                if self.lease:  # a lease ends in time even on a connection kept busy
                    wait = self.lease_since + self.timeout_s - time.monotonic()
                try:
                    if wait <= 0:
                        raise TimeoutError
                    async with asyncio.timeout(wait):
                        got = await asyncio.get_running_loop().sock_recv_into(
                            self.sock, memoryview(head)[:1]
                        )
                except TimeoutError:
                    if self.lease:
                        self.port.lease_timeouts += 1
                        logger.info(
                            "local socket: closing a client that held a lease for %.0fs "
                            "(--data-timeout)",
                            self.timeout_s,
                        )
                    return
                if not got:
                    self.peer_closed = True  # it writes nothing more
                    return
                self.idle = False
                if not await self._request(head):
                    return
        except (OSError, _Closed):
            return
        finally:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # first: the client must see the end ...
            self.sock.close()
            self._release()  # ... before its lease's memory can be reused
            if self.reserved and not self.peer_closed:  # the client may still be writing them
                held = list(self.reserved.values())
                asyncio.get_running_loop().call_later(self.timeout_s, held.clear)
            self._unreserve()
            if self.staging is not None:
                self.staging.close()
                self._unstage()

    async def _recv(self, view: memoryview) -> None:
        if await self.stream.recv_into(view) < view.nbytes:
            raise _Closed

    async def _send(self, data: Buffer, fds: Sequence[int] = ()) -> None:
        """Sends ``data``, the file descriptors ``fds`` riding on its first bytes."""
        view = memoryview(data).cast("B")
        if fds:
            loop = asyncio.get_running_loop()
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            async with asyncio.timeout(self.timeout_s):
                while True:
                    try:
                        sent = self.sock.sendmsg([view], ancillary)
                        break
                    except BlockingIOError:
                        ready = loop.create_future()
                        loop.add_writer(self.sock, ready.set_result, None)
                        try:
                            await ready
                        finally:
                            loop.remove_writer(self.sock)
            view = view[sent:]
        if view.nbytes:
            await self.stream.send(view)

    async def _request(self, head: bytearray) -> bool:
        """Serves one request whose first byte is in ``head``; False: close the connection."""
        start = time.perf_counter()
        op_name, code, keep = "LocalInvalid", Status.OK, True
        op = 0
        try:
            await self._recv(memoryview(head)[1:])
            op, flags, count, table_len = _header(head)
            op_name = _OP_NAMES[Op(op)]
            if op in (Op.RELEASE, Op.STATS) and (count or table_len):
                raise Lost(
                    InvalidRequest(
                        f"{op_name}: count {count}, table_len {table_len}; both must be 0"
                    )
                )
            if op == Op.RELEASE:  # no reply; allowed whatever the token
                self._release()
                return True
            if op == Op.HELLO:
                await self._hello(await self._hello_table(table_len))
                return True
            tenant = self.core.tenant(self.authorization)  # before anything declared is read
            if op == Op.STATS:
                body = _stats_response(self.core.stats(tenant)).SerializeToString()
                await self._send(lw.reply(op, Status.OK, extra=len(body)) + body)
            elif op == Op.STAGE:
                await self._stage(await self._table(op_name, 1, table_len, exact=lw.STAGE.size))
            elif op == Op.RESERVE:
                table = await self._table(
                    op_name, count, table_len, exact=count * lw.RESERVE_ITEM.size
                )
                await self._reserve(table, tenant)
            elif op == Op.PUT:
                table = await self._table(op_name, count, table_len)
                items = parse_put_items(self.core, count, table)
                if flags & lw.FLAG_RESERVED:
                    await self._put_reserved(items, tenant)
                else:
                    await self._put(items, tenant)
            else:
                keys = parse_keys(
                    self.core, op_name, count, await self._table(op_name, count, table_len)
                )
                if op == Op.GET:
                    await self._get(
                        keys,
                        tenant,
                        bool(flags & lw.FLAG_STOP_AT_FIRST_MISS),
                        bool(flags & lw.FLAG_FILES),
                    )
                elif op == Op.LOOKUP:
                    await self._send(
                        lw.reply(op, Status.OK, count=await self.core.lookup(tenant, keys))
                    )
                else:
                    await self._send(
                        lw.reply(op, Status.OK, count=await self.core.delete(tenant, keys))
                    )
        except Lost as lost:
            code, keep = await self._refuse(op, lost.error), False
            logger.info("local socket: closing a client: %s", lost)
        except _PutRefused as refused:
            code = await self._refuse(op, refused.error, count=refused.stored)
        except RequestError as exc:
            keep = not isinstance(exc, Unauthenticated)
            code = await self._refuse(op, exc)
        except TimeoutError:
            code, keep = Status.DEADLINE_EXCEEDED, False
            logger.info(
                "local socket: closing a client stalled for %.0fs inside a request", self.timeout_s
            )
        except (_Closed, OSError):
            code, keep = Status.CANCELLED, False
        except asyncio.CancelledError:
            code, keep = Status.CANCELLED, False
            raise
        except Exception:
            code, keep = Status.INTERNAL, False
            logger.exception("%s failed", op_name)
            with contextlib.suppress(OSError, TimeoutError):  # the client closes after it
                await self._send(
                    lw.reply(op, code, text=f"{op_name}: internal error (see the server log)")
                )
        finally:
            if op != Op.RELEASE:
                self.core.answered(op_name, code.name, start)
        return keep

    async def _refuse(self, op: int, error: RequestError, count: int = 0) -> Status:
        status = status_of(error)
        with contextlib.suppress(OSError, TimeoutError):
            await self._send(lw.reply(op, status, count=count, text=str(error)))
        return status

    async def _discard(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, DISCARD_BYTES)))
        while n:
            k = min(n, scratch.nbytes)
            await self._recv(scratch[:k])
            n -= k

    async def _hello_table(self, table_len: int) -> bytes:
        if table_len > lw.MAX_HELLO_BYTES:
            raise Lost(
                LimitExceeded(
                    f"LocalHello.table_len: {table_len} bytes; at most {lw.MAX_HELLO_BYTES}"
                )
            )
        table = bytearray(table_len)
        await self._recv(memoryview(table))
        return bytes(table)

    async def _table(
        self, op_name: str, count: int, table_len: int, exact: int | None = None
    ) -> bytearray:
        """Reads a request's table, refusing what it cannot hold before allocating it."""
        if table_len > lw.MAX_TABLE_BYTES:
            raise Lost(
                LimitExceeded(
                    f"{op_name}.table_len: {table_len} bytes; at most {lw.MAX_TABLE_BYTES}"
                )
            )
        if exact is not None and table_len != exact:
            raise Lost(InvalidRequest(f"{op_name}.table_len: {table_len} bytes; expected {exact}"))
        try:
            self.core.check_count(f"{op_name}.count", count)
        except LimitExceeded:
            await self._discard(table_len)
            raise
        bound = count * (lw.PUT_ITEM.size + 0xFFFF) if exact is None else exact
        if table_len > bound:
            raise Lost(
                LimitExceeded(
                    f"{op_name}.table_len: {table_len} bytes; {count} keys take at most {bound}"
                )
            )
        try:
            held = self.core.reserve(f"{op_name}.table_len", table_len)
        except Overloaded:
            await self._discard(table_len)
            raise
        with held:
            table = bytearray(table_len)
            await self._recv(memoryview(table))
            return table

    # -- requests ---------------------------------------------------------------------

    async def _hello(self, table: bytes) -> None:
        self._unreserve()  # reserved in the tenant's memory: gone if the tenant changes
        try:
            self.authorization = table.decode() if table else None
        except UnicodeDecodeError:
            raise Unauthenticated("LocalHello: the authorization value is not UTF-8") from None
        tenant = self.core.tenant(self.authorization)
        await self._send(lw.reply(Op.HELLO, Status.OK, text=tenant))

    async def _get(self, keys: list[bytes], tenant: str, stop_at_first_miss: bool, files: bool) -> None:
        self._release()  # a connection holds one lease: its last Get's
        entries = bytearray()
        inline: list[memoryview] = []
        handed: list[int] = []  # segments whose fds go with this reply
        opened: list[tuple[int, RecordFile]] = []  # (entry index, record file) of FILE entries
        n = 0
        # Record files for at most MAX_FDS values, and only when the client has read all
        # we sent it before: descriptors sent but not yet received count against the tier's
        # own descriptor limit, so a client that never reads holds at most one reply's.
        budget = lw.MAX_FDS if files and self._peer_read_all() else 0
        values = self.core.get(tenant, keys, stop_at_first_miss, files=budget)
        try:
            async with contextlib.aclosing(values):
                async for _, value in values:
                    n += 1
                    if value is None:
                        entries += lw.ENTRY.pack(Place.MISSING, 0, 0, 0, 0)
                        continue
                    if isinstance(value, RecordFile):
                        opened.append((n - 1, value))
                        entries += lw.ENTRY.pack(
                            Place.FILE, value.key_len, record.HEADER_SIZE, value.value_len, value.checksum
                        )
                        continue
                    view = memoryview(value)
                    extent = self.arena.locate(view)
                    if extent is None:
                        entries += lw.ENTRY.pack(Place.INLINE, 0, 0, view.nbytes, 0)
                        inline.append(view)
                        continue
                    if extent.segment not in self.segments and extent.segment not in handed:
                        handed.append(extent.segment)
                    crc = self.arena.checksum(view, extent)
                    entries += lw.ENTRY.pack(
                        Place.SHARED, extent.segment, extent.offset, extent.length, crc
                    )
                    if id(extent) not in self.leased:  # a value named twice is leased once
                        self.leased.add(id(extent))
                        self.lease.append(view)
                        self.lease_bytes += extent.span
                        self.port.leased_bytes += extent.span
            self.lease_since = time.monotonic()
            segments = [self.arena.segments[s] for s in handed]
            head = lw.reply(Op.GET, Status.OK, count=n, extra=len(segments))
            await self._send_segments(head, [(s, s.read_fd) for s in segments])
            self.segments.update(handed)
            await self._send_entries(entries, opened)
            for view in inline:
                await self._send(view)
        finally:
            for _, opened_file in opened:
                opened_file.close()  # the client holds its own descriptors now

    async def _send_segments(self, head: bytes, segments: list[tuple[Segment, int]]) -> None:
        """Sends a reply's head and its SEGMENT records, each record's fd riding on it (at
        most ``MAX_FDS`` per message)."""
        for i in range(0, max(1, len(segments)), lw.MAX_FDS):
            part = segments[i : i + lw.MAX_FDS]
            records = b"".join(lw.SEGMENT.pack(s.id, s.size) for s, _ in part)
            await self._send((head if i == 0 else b"") + records, [fd for _, fd in part])

    def _peer_read_all(self) -> bool:
        """Whether the client has received every byte (and descriptor) sent to it so far."""
        try:
            queued = array.array("i", [0])
            fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, queued)  # SIOCOUTQ
        except OSError:
            return False
        return queued[0] == 0

    async def _send_entries(self, entries: bytearray, opened: list[tuple[int, RecordFile]]) -> None:
        """Sends a Get's entries, the fds of its FILE entries riding on them: at most
        ``MAX_FDS`` per message, each message starting at the entry of its first fd."""
        starts = [0] + [opened[i][0] for i in range(lw.MAX_FDS, len(opened), lw.MAX_FDS)]
        ends = [*starts[1:], len(entries) // lw.ENTRY.size]
        for k, (start, end) in enumerate(zip(starts, ends, strict=True)):
            fds = [f.fd for _, f in opened[k * lw.MAX_FDS : (k + 1) * lw.MAX_FDS]]
            part = memoryview(entries)[start * lw.ENTRY.size : end * lw.ENTRY.size]
            if part.nbytes:
                await self._send(part, fds)

    def _release(self) -> None:
        if self.lease:
            self.port.leased_bytes -= self.lease_bytes
            self.lease.clear()  # the views go: their extents are free once nothing else holds them
            self.leased.clear()
            self.lease_bytes = 0
            self.arena.reclaim()

    async def _stage(self, table: bytearray) -> None:
        (size,) = lw.STAGE.unpack(table)
        limit = self.core.settings.incoming_bytes
        if size == 0:
            raise InvalidRequest("LocalStage.size: 0 bytes; a staging segment is 1 byte or more")
        if size > limit:
            raise LimitExceeded(
                f"LocalStage.size: {size} bytes; a staging segment is at most {limit} bytes "
                "(--incoming-bytes)"
            )
        if self.staging is not None:  # replaced: its reservation goes first
            self.staging.close()
            self.staging = None
            self._unstage()
        self.staging_held = self.core.reserve("LocalStage.size", size)
        try:
            staging = _Staging(size)
        except OSError:
            self._unstage()
            raise
        self.staging = staging
        try:
            await self._send(lw.reply(Op.STAGE, Status.OK, extra=1), [staging.fd])
        finally:
            staging.close_fd()  # the tier keeps its mapping; the client its fd

    async def _reserve(self, table: bytearray, tenant: str) -> None:
        self._unreserve()  # a connection holds one RESERVE's extents
        sizes = [size for (size,) in lw.RESERVE_ITEM.iter_unpack(table)]
        for i, size in enumerate(sizes):
            self.core.check_value_length(f"LocalReserve.sizes[{i}]", size)
        self.reserved_held = self.core.reserve("LocalReserve.sizes", sum(sizes))
        reserved = await self._take(sizes, tenant)
        if reserved is None:  # the client stages these values instead
            self._unreserve()
            await self._send(lw.reply(Op.RESERVE, Status.OK))
            return
        self.reserved, self.reserved_tenant = reserved, tenant
        places = bytearray()
        handed: list[Segment] = []
        for view in reserved.values():
            extent = self.arena.locate(view)
            assert extent is not None
            segment = self.arena.segments[extent.segment]
            if extent.segment not in self.writable and segment not in handed:
                handed.append(segment)
            places += lw.PLACE.pack(extent.segment, extent.offset)
        head = lw.reply(Op.RESERVE, Status.OK, count=len(sizes), extra=len(handed))
        await self._send_segments(head, [(s, s.fd) for s in handed])
        self.writable.update(s.id for s in handed)
        self.segments.update(s.id for s in handed)
        await self._send(places)

    async def _take(self, sizes: list[int], tenant: str) -> dict[int, memoryview] | None:
        """Extents for values of ``sizes`` in the tenant's writable segments, their pages
        faulted in by the tier (so they are charged to it, not to the client that writes
        them first); None when a value is small, only the disk tier takes it (it is written
        from the staging segment in one pass, ``Store.put_checked``), or no room or memory
        is left now."""
        reserved: dict[int, memoryview] = {}
        for i, size in enumerate(sizes):
            if not size or self.core.store.writes_checked(size):
                return None
            view = self.arena.take(size, tenant, writable=True)
            if view is None:
                return None
            reserved[i] = view
        cold = [v for v in reserved.values() if self.arena.unpopulated(v)]
        if cold:
            try:
                await asyncio.to_thread(self.arena.populate, cold)
            except OSError as exc:  # out of memory
                logger.warning("local socket: cannot fault reserved memory in (%s)", exc)
                return None
        return reserved

    def _unreserve(self) -> None:
        self.reserved = {}  # the views go: their extents are free once nothing else holds them
        held, self.reserved_held = self.reserved_held, None
        if held is not None:
            held.release()
        self.arena.reclaim()

    async def _put_reserved(self, items: list[tuple[bytes, int, int, int]], tenant: str) -> None:
        """Stores values the client wrote into its reservations (after RESERVE)."""
        if tenant != self.reserved_tenant:  # the token's tenant changed: not its memory
            self._unreserve()
        stored = rejected = 0
        for i, (key, index, length, crc) in enumerate(items):
            view = self.reserved.pop(index, None)
            if view is None or view.nbytes != length:
                held = "not held (never reserved, or stored or refused already)" if view is None else f"{view.nbytes} bytes"
                raise _PutRefused(
                    InvalidRequest(
                        f"LocalPut.values[{i}].length: {length} bytes into reservation {index}, "
                        f"which is {held} (RESERVE first; each reservation is stored once)"
                    ),
                    stored,
                )
            extent = self.arena.locate(view)
            assert extent is not None
            # The writer's checksum is recorded, not re-computed: the tenant can change
            # this memory after any check the tier could make, and every same-node reader
            # checks it as it copies (module docstring, "Trust").
            extent.checksum = crc
            if await self.core.store_value(tenant, key, view.toreadonly()):
                stored += 1
            else:
                rejected += 1
        if not self.reserved:
            self._unreserve()  # every reservation stored: the incoming budget goes back
        await self._send(lw.reply(Op.PUT, Status.OK, count=stored, extra=rejected))

    def _unstage(self) -> None:
        held, self.staging_held = self.staging_held, None
        if held is not None:
            held.release()

    async def _put(self, items: list[tuple[bytes, int, int, int]], tenant: str) -> None:
        staging = self.staging
        stored = rejected = 0
        for i, (key, offset, length, crc) in enumerate(items):
            if staging is None or offset + length > staging.size:
                size = 0 if staging is None else staging.size
                raise _PutRefused(
                    InvalidRequest(
                        f"LocalPut.values[{i}]: bytes {offset}..{offset + length} are outside the "
                        f"staging segment ({size} bytes; STAGE one first)"
                    ),
                    stored,
                )
            source = staging.view[offset : offset + length]
            try:
                took = await self.core.store_checked(tenant, key, source, crc)
                if took is None:
                    took = await self._store_copy(tenant, key, source, crc)
            except ChecksumMismatch:
                raise _PutRefused(
                    InvalidRequest(
                        f"LocalPut.values[{i}].checksum: the staged bytes do not match it (changed while "
                        "being stored?); that value and the ones after it were not stored"
                    ),
                    stored,
                ) from None
            if took:
                stored += 1
            else:
                rejected += 1
        await self._send(lw.reply(Op.PUT, Status.OK, count=stored, extra=rejected))

    async def _store_copy(self, tenant: str, key: bytes, source: memoryview, crc: int) -> bool:
        """Stores a copy of ``source`` in the tier's own memory, checked on what was copied."""
        buf = memoryview(self.core.receive_buffer(source.nbytes, tenant))
        got = lw.copy_checked(buf, source)
        if got != crc:
            raise ChecksumMismatch(f"the bytes copied hash to {got:#x}, not the checksum {crc:#x} sent")
        extent = self.arena.locate(buf)
        if extent is not None:
            extent.checksum = got
        return await self.core.store_value(tenant, key, buf.toreadonly())


class _PutRefused(Exception):
    def __init__(self, error: RequestError, stored: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.stored = stored


def _header(head: bytearray) -> tuple[int, int, int, int]:
    magic, version, op, flags, count, table_len = lw.REQUEST.unpack(head)
    if magic != lw.MAGIC:
        raise Lost(
            InvalidRequest(
                "local socket request: bad magic (expected b'KVTL'): not a kvtier client"
            )
        )
    if version != lw.VERSION:
        raise Lost(
            InvalidRequest(
                f"local socket request: version {version}; this server speaks {lw.VERSION}"
            )
        )
    if op not in _OP_NAMES:
        known = ", ".join(f"{o.value} {o.name}" for o in Op)
        raise Lost(InvalidRequest(f"local socket request: unknown op {op} ({known})"))
    return op, flags, count, table_len
