"""``LocalTransport``: every call over the tier's Unix socket, values through shared memory.

The same-node transport (``kvtier.proto.localwire``; docs/protocol.md, "Same-node
transport") for a client on the tier's node: Lookup, Delete and Stats are control
messages on the socket; a Get answers where each value lies in the tier's memfd
segments (read-only file descriptors arrive with the reply, ``SCM_RIGHTS``, and are
mapped once per connection), and the client copies the values out into its receive
buffers (``kvtier.proto.buffers.ReceiveBuffers``), checking each value's checksum in the
same pass, then releases its lease; a Put reserves room for its values in the tier's
memory (RESERVE: extents of the tenant's own segments, mapped read-write), writes each
value there, hashing it as it copies, and has the tier store them (PUT with
``FLAG_RESERVED``): one copy. When the tier has no room to reserve, the values go
through the connection's staging segment (one the tier gave it) and the tier copies
them into its own memory.
A value the tier holds only on disk arrives as its record file (a read-only descriptor,
``FLAG_FILES``): the client reads the value from the page cache itself and checks the
record's checksum (``localwire.read_checked``); a record that fails it is deleted and is
a miss, as when the tier finds one.

Integrity: the tier does not reuse a leased value's memory, and if it ends a lease (a
client too slow for ``--data-timeout``) it closes the connection *first*: so a Get whose
connection is still open after its copies copied whole values, and the checksums say so
again. A Get that finds its connection closed, or a checksum that does not match, fails
the call (``TierUnavailable``), never returns the bytes.

Puts are pipelined: values go in requests of up to ``PIPELINE_BYTES``, and while the tier
stores (reserved) or copies (staged: the staging segment's other half) one request's
values, the client writes the next request's. The tier records the checksum the client
sends with a reserved value without reading the value (memory the tenant's clients can
write anyway); every same-node reader checks it as it copies.

Errors as ``DataPortTransport``'s: ``TransportUnreachable`` when the socket cannot be
connected (no file, nobody listening, no permission: another transport may serve),
else ``TierUnavailable`` or ``TierRejected`` with gRPC's code names
(``kvtier.connector.client.pool``: the connections and the error mapping both socket
transports share).
"""

from __future__ import annotations

import array
import contextlib
import logging
import mmap
import os
import socket
from collections import deque
from collections.abc import Sequence

from typing_extensions import Buffer

from kvtier.connector.client.codes import code_name
from kvtier.connector.client.pool import MAX_IDLE, Broken, ConnectionPool, Deadline, Refused
from kvtier.connector.client.transport import Items, TransportUnreachable, Values
from kvtier.connector.errors import TierRejected
from kvtier.proto import cache_pb2
from kvtier.proto import localwire as lw
from kvtier.proto.buffers import ReceiveBuffers
from kvtier.proto.localwire import Op, Place, Status

logger = logging.getLogger(__name__)

STAGING_ROUND = 1 << 20
# Values start at multiples of 64 bytes in the staging segment: the tier copies each one
# into a page-aligned extent of its own segments, and a copy whose destination lies a few
# bytes past its source modulo 4 KiB runs at a third to a half of its speed on these AMD
# CPUs (docs/benchmarks.md, "Same-node copies and alignment").
ALIGN = 64
PIPELINE_BYTES = 16 << 20  # what a Put request carries at most when its values are smaller
RESERVE_BYTES = 64 << 20  # what one RESERVE asks for at most (unless one value is larger)
_ANCILLARY = socket.CMSG_SPACE(lw.MAX_FDS * array.array("i").itemsize)


class _Staging:
    def __init__(self, fd: int, size: int) -> None:
        try:
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.view = memoryview(self.map)


class _Conn:
    """One connection: its socket, the tier's segments it mapped, its staging segment."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fds: deque[int] = deque()
        self.segments: dict[int, memoryview] = {}
        self.staging: _Staging | None = None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        while self.fds:
            with contextlib.suppress(OSError):
                os.close(self.fds.popleft())
        for view in self.segments.values():
            _unmap(view)
        self.segments.clear()
        if self.staging is not None:
            _unmap(self.staging.view)
            self.staging = None

    def recv_into(self, view: memoryview, deadline: Deadline) -> None:
        got, n = 0, view.nbytes
        while got < n:
            deadline.arm(self.sock)
            k, ancillary, flags, _ = self.sock.recvmsg_into([view[got:]], _ANCILLARY)
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                    self.fds.extend(fds)
            if flags & socket.MSG_CTRUNC:
                raise ConnectionError("file descriptors from the tier were cut off")
            if not k:
                raise ConnectionError("the tier closed the local connection")
            got += k

    def recv(self, n: int, deadline: Deadline) -> bytearray:
        buf = bytearray(n)
        self.recv_into(memoryview(buf), deadline)
        return buf

    def send(self, data: Sequence[Buffer], deadline: Deadline) -> None:
        for part in data:
            if not memoryview(part).nbytes:  # a send of nothing to a tier that already
                continue  # answered and closed (an empty HELLO refused) fails with EPIPE
            deadline.arm(self.sock)
            self.sock.sendall(part)

    def reply(self, op: Op, deadline: Deadline) -> tuple[int, int, str]:
        """Reads a reply header and text; returns (count, extra, text) or raises Refused."""
        magic, version, _op, status, count, extra, text_len = lw.REPLY.unpack(
            self.recv(lw.REPLY.size, deadline)
        )
        if magic != lw.MAGIC or version != lw.VERSION:
            raise ConnectionError(f"not a kvtier local reply (magic {magic!r}, version {version})")
        text = self.recv(text_len, deadline).decode(errors="replace") if text_len else ""
        if status != Status.OK:
            raise Refused(status, text, count)
        return count, extra, text

    def map_segments(self, n: int, deadline: Deadline, writable: bool = False) -> None:
        """Maps the ``n`` segments a reply handed over (their records, then their fds)."""
        records = self.recv(n * lw.SEGMENT.size, deadline)
        for i in range(n):
            segment, size = lw.SEGMENT.unpack_from(records, i * lw.SEGMENT.size)
            if not self.fds:
                raise ConnectionError("the tier named a segment but sent no file descriptor")
            fd = self.fds.popleft()
            try:
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
            finally:
                os.close(fd)
            old = self.segments.pop(segment, None)
            if old is not None:
                _unmap(old)
            self.segments[segment] = memoryview(mapped)

    def still_open(self) -> bool:
        """Whether the tier has not closed this connection (nothing may be waiting on it)."""
        self.sock.settimeout(0.0)  # a peek that never waits (the next call arms a deadline)
        try:
            data = self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if data:
            raise ConnectionError("the tier sent bytes nobody asked for")
        return False


class _FileValue:
    """A Get's FILE entry: a record file's descriptor, where its key starts, its key's
    length and its checksum; the value goes into ``buf``, entry ``index`` of the Get."""

    __slots__ = ("buf", "checksum", "fd", "index", "key_len", "offset")

    def __init__(self, index: int, buf: memoryview, fd: int, offset: int, key_len: int, checksum: int) -> None:
        self.index, self.buf, self.fd = index, buf, fd
        self.offset, self.key_len, self.checksum = offset, key_len, checksum

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)


def _read_files(files: list[_FileValue]) -> list[int]:
    """Reads each record file's key and value (the value into its buffer) and checks the
    record's checksum; returns the entries that failed it (or ended early)."""
    corrupt = []
    for f in files:
        try:
            got = lw.read_checked(f.fd, f.offset, f.buf, f.key_len)
        except EOFError:
            corrupt.append(f.index)
            continue
        except OSError as exc:
            raise Broken(f"reading a record file of the tier failed: {exc}") from exc
        if got != f.checksum:
            corrupt.append(f.index)
    return corrupt


def _aligned(offset: int) -> int:
    """``offset`` rounded up to a multiple of ``ALIGN``."""
    return -(-offset // ALIGN) * ALIGN


def _unmap(view: memoryview) -> None:
    mapped = view.obj
    view.release()
    if isinstance(mapped, mmap.mmap):
        with contextlib.suppress(BufferError):  # a caller still holds a view: unmapped with it
            mapped.close()


class LocalTransport(ConnectionPool[_Conn]):
    name = "local"

    def __init__(
        self,
        path: str,
        *,
        authorization: str | None,
        buffers: ReceiveBuffers | None = None,
        max_idle: int = MAX_IDLE,
    ) -> None:
        """``path``: the tier's Unix socket (``--local-socket``). ``authorization``: the
        HELLO of every new connection ("Bearer <token>")."""
        super().__init__(max_idle)
        self.path = path
        self.where = f"local socket {path}"
        self.authorization = authorization
        self.buffers = buffers if buffers is not None else ReceiveBuffers(0)

    def connect(self, *, timeout_s: float) -> None:
        """Opens one connection now (kept for the next call); raises TransportUnreachable
        when nothing answers on the socket, TierRejected when the tier refuses the token."""
        self._release(self._connect(Deadline(timeout_s)))

    # -- calls ----------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], *, timeout_s: float) -> int:
        return self._keys_call("Lookup", Op.LOOKUP, keys, timeout_s)

    def delete(self, keys: Sequence[bytes], *, timeout_s: float) -> int:
        return self._keys_call("Delete", Op.DELETE, keys, timeout_s)

    def stats(self, *, timeout_s: float) -> cache_pb2.StatsResponse:
        def call(conn: _Conn, deadline: Deadline) -> cache_pb2.StatsResponse:
            conn.send([lw.request(Op.STATS)], deadline)
            _, size, _ = conn.reply(Op.STATS, deadline)
            return cache_pb2.StatsResponse.FromString(bytes(conn.recv(size, deadline)))

        return self._call("Stats", call, timeout_s)

    def get(self, keys: Sequence[bytes], *, stop_at_first_miss: bool, timeout_s: float) -> Values:
        flags = lw.FLAG_FILES | (lw.FLAG_STOP_AT_FIRST_MISS if stop_at_first_miss else 0)
        table = lw.key_table(list(keys))
        request = lw.request(Op.GET, len(keys), len(table), flags)

        def call(conn: _Conn, deadline: Deadline) -> Values:
            conn.send([request, table], deadline)
            count, segments, _ = conn.reply(Op.GET, deadline)
            conn.map_segments(segments, deadline)
            raw = conn.recv(count * lw.ENTRY.size, deadline)
            entries = [lw.ENTRY.unpack_from(raw, i * lw.ENTRY.size) for i in range(count)]
            out: Values = []
            shared: list[tuple[memoryview, memoryview, int]] = []  # destination, source, checksum
            files: list[_FileValue] = []
            try:
                for place, segment, offset, length, crc in entries:
                    if place == Place.MISSING:
                        out.append(None)
                        continue
                    buf = memoryview(self.buffers.take(length))
                    if place == Place.INLINE:
                        conn.recv_into(buf, deadline)  # inline values follow the entries, in order
                    elif place == Place.FILE:
                        if not conn.fds:
                            raise ConnectionError("the tier named a record file but sent no descriptor")
                        files.append(_FileValue(len(out), buf, conn.fds.popleft(), offset, segment, crc))
                    else:
                        source = conn.segments.get(segment)
                        if source is None or offset + length > source.nbytes:
                            raise ConnectionError(f"the tier named bytes outside segment {segment}")
                        shared.append((buf, source[offset : offset + length], crc))
                    out.append(buf.toreadonly())
                for i, (buf, source, crc) in enumerate(shared):
                    if lw.copy_checked(buf, source) != crc:
                        raise Broken(f"value {i} of the Get failed its checksum after the copy")
                if shared:
                    if not conn.still_open():
                        raise Broken("the tier ended this connection's lease during the copy")
                    conn.send([lw.request(Op.RELEASE)], deadline)
                corrupt = _read_files(files)
            finally:
                for f in files:
                    f.close()
            if corrupt:  # as the tier does with a record that fails verification: deleted, a miss
                logger.warning("kvtier: %d record file(s) of the tier failed their checksum; "
                               "deleting them", len(corrupt))  # fmt: skip
                bad = lw.key_table([keys[i] for i in corrupt])
                conn.send([lw.request(Op.DELETE, len(corrupt), len(bad)), bad], deadline)
                try:
                    conn.reply(Op.DELETE, deadline)
                except Refused as refused:  # still a miss; the tier's own read deletes it later
                    logger.warning("kvtier: deleting the failed record file(s) was refused: %s", refused)
                for i in corrupt:
                    out[i] = None
                if stop_at_first_miss:
                    del out[corrupt[0] + 1 :]
            return out

        return self._call("Get", call, timeout_s)

    def put(self, items: Items, *, timeout_s: float) -> int:
        values = [(key, [memoryview(p).cast("B") for p in parts]) for key, parts in items]
        lengths = [sum(p.nbytes for p in parts) for _, parts in values]

        def call(conn: _Conn, deadline: Deadline) -> int:
            stored = start = 0
            while start < len(values):
                end, total = start + 1, lengths[start]
                while end < len(values) and total + lengths[end] <= RESERVE_BYTES:
                    total += lengths[end]
                    end += 1
                places = self._reserve(conn, lengths[start:end], deadline)
                if places is None:  # no room, a small or a disk-only value: through the staging segment
                    stored += self._put_staged(conn, values[start:end], lengths[start:end], deadline)
                else:
                    stored += self._put_reserved(conn, values[start:end], lengths[start:end], places, deadline)
                start = end
            return stored

        return self._call("Put", call, timeout_s)

    def _reserve(self, conn: _Conn, lengths: list[int], deadline: Deadline) -> list[memoryview] | None:
        """Room for values of ``lengths`` in the tier's memory, or None (the tier has none now)."""
        if min(lengths) == 0:
            return None
        table = b"".join(lw.RESERVE_ITEM.pack(n) for n in lengths)
        conn.send([lw.request(Op.RESERVE, len(lengths), len(table)), table], deadline)
        try:
            count, segments, _ = conn.reply(Op.RESERVE, deadline)
        except Refused as exc:  # over the tier's incoming budget now: staged values wait for room
            if exc.status == Status.UNAVAILABLE:
                return None
            raise
        conn.map_segments(segments, deadline, writable=True)
        if count == 0:
            return None
        if count != len(lengths):
            raise ConnectionError(f"the tier reserved {count} of {len(lengths)} values")
        raw = conn.recv(count * lw.PLACE.size, deadline)
        places = []
        for i, (segment, offset) in enumerate(lw.PLACE.iter_unpack(raw)):
            target = conn.segments.get(segment)
            if target is None or target.readonly or offset + lengths[i] > target.nbytes:
                raise ConnectionError(f"the tier reserved bytes outside writable segment {segment}")
            places.append(target[offset : offset + lengths[i]])
        return places

    def _put_reserved(
        self, conn: _Conn, values: list[tuple[bytes, list[memoryview]]], lengths: list[int],
        places: list[memoryview], deadline: Deadline,
    ) -> int:
        """Writes each value into its reservation and has the tier store it, in requests of
        up to ``PIPELINE_BYTES`` sent without waiting (the tier stores one while the next is
        written); every reply is read at the end."""
        pending = i = 0
        while i < len(values):
            table: list[tuple[bytes, int, int, int]] = []
            used = 0
            while i < len(values) and (not table or used + lengths[i] <= PIPELINE_BYTES):
                key, parts = values[i]
                table.append((key, i, lengths[i], lw.copy_streamed(places[i], *parts)))
                used += lengths[i]
                i += 1
            raw = lw.put_table(table)
            conn.send([lw.request(Op.PUT, len(table), len(raw), lw.FLAG_RESERVED), raw], deadline)
            pending += 1
        stored = 0
        for _ in range(pending):
            stored += conn.reply(Op.PUT, deadline)[0]
        return stored

    def _put_staged(
        self, conn: _Conn, values: list[tuple[bytes, list[memoryview]]], lengths: list[int],
        deadline: Deadline,
    ) -> int:
        """Writes values into the staging segment, two halves in turn, and has the tier copy
        them out."""
        staging = self._staging(conn, max(lengths), sum(lengths), deadline)
        halves = 2 if staging.size >= 2 * max(lengths) else 1
        region = staging.size // halves
        stored = 0
        pending: deque[int] = deque()  # requests sent and not yet answered
        i = turn = 0
        while i < len(values):
            group: list[tuple[int, int]] = []  # (value, its offset in the region)
            used = 0
            while i < len(values) and _aligned(used) + lengths[i] <= region:
                group.append((i, _aligned(used)))
                used = _aligned(used) + lengths[i]
                i += 1
            assert group, "a region holds at least the largest value"
            while len(pending) >= halves:  # the region's last request must be answered
                stored += self._put_reply(conn, pending, deadline)
            base, turn = region * (turn % halves), turn + 1
            table = []
            for j, at in group:
                key, parts = values[j]
                offset = base + at
                crc = lw.copy_checked(staging.view[offset : offset + lengths[j]], *parts)
                table.append((key, offset, lengths[j], crc))
            raw = lw.put_table(table)
            conn.send([lw.request(Op.PUT, len(table), len(raw)), raw], deadline)
            pending.append(len(table))
        while pending:
            stored += self._put_reply(conn, pending, deadline)
        return stored

    # -- helpers --------------------------------------------------------------------

    def _put_reply(self, conn: _Conn, pending: deque[int], deadline: Deadline) -> int:
        pending.popleft()
        stored, _, _ = conn.reply(Op.PUT, deadline)
        return stored

    def _staging(self, conn: _Conn, largest: int, total: int, deadline: Deadline) -> _Staging:
        """The connection's staging segment: two halves of at least ``largest`` bytes
        (pipelined; up to ``PIPELINE_BYTES`` each, so that small values go a few to a
        request), or room for one value when the tier cannot give more."""
        if conn.staging is not None and conn.staging.size >= largest:
            return conn.staging
        half = max(largest, min(total, PIPELINE_BYTES))
        want = -(-2 * half // STAGING_ROUND) * STAGING_ROUND
        for size in (want, largest):
            try:
                conn.send([lw.request(Op.STAGE, 0, lw.STAGE.size), lw.STAGE.pack(size)], deadline)
                conn.reply(Op.STAGE, deadline)
            except Refused as exc:  # no room for two values (now, or ever): one
                if (
                    exc.status in (Status.UNAVAILABLE, Status.RESOURCE_EXHAUSTED)
                    and size != largest
                ):
                    continue
                raise
            if not conn.fds:
                raise ConnectionError("the tier sent no staging segment")
            if conn.staging is not None:
                _unmap(conn.staging.view)
            conn.staging = _Staging(conn.fds.popleft(), size)
            return conn.staging
        raise AssertionError("unreachable")

    def _keys_call(self, op_name: str, op: Op, keys: Sequence[bytes], timeout_s: float) -> int:
        table = lw.key_table(list(keys))
        request = lw.request(op, len(keys), len(table))

        def call(conn: _Conn, deadline: Deadline) -> int:
            conn.send([request, table], deadline)
            count, _, _ = conn.reply(op, deadline)
            return count

        return self._call(op_name, call, timeout_s)

    def _connect(self, deadline: Deadline) -> _Conn:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(deadline.connect_timeout())
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise TransportUnreachable(
                f"cannot connect to the local socket {self.path}: {exc}"
            ) from exc
        conn = _Conn(sock)
        try:
            auth = (self.authorization or "").encode()
            conn.send([lw.request(Op.HELLO, 0, len(auth)), auth], deadline)
            conn.reply(Op.HELLO, deadline)
        except Refused as exc:
            conn.close()
            raise TierRejected(
                f"LocalHello: {code_name(exc.status)}: {exc}", code_name(exc.status)
            ) from exc
        except (OSError, ConnectionError) as exc:
            conn.close()
            raise TransportUnreachable(f"local socket {self.path}: {exc}") from exc
        return conn
