"""A raw client of the same-node transport, for what ``LocalTransport`` never does.

Tests use it to hold a lease and stop (as a client that hangs or dies mid-copy does),
to send malformed or hostile requests, and to look at the replies byte for byte
(``kvtier.proto.localwire``). Blocking, one connection, no deadlines beyond the
socket's timeout.
"""

from __future__ import annotations

import array
import contextlib
import mmap
import os
import socket
from dataclasses import dataclass

from kvtier.proto import localwire as lw
from kvtier.proto.localwire import Op, Place

ANCILLARY = socket.CMSG_SPACE(lw.MAX_FDS * 4)


@dataclass(frozen=True)
class Reply:
    op: int
    status: int
    count: int
    extra: int
    text: str


@dataclass(frozen=True)
class Entry:
    place: int
    segment: int
    offset: int
    length: int
    checksum: int
    inline: bytes = b""
    fd: int = -1  # a FILE entry's record file (kept open until close)


class RawLocal:
    def __init__(self, path: str, authorization: str | None = None, timeout_s: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)
        self.fds: list[int] = []
        self.segments: dict[int, mmap.mmap] = {}
        self.segment_fds: dict[int, int] = {}  # kept open (tests reopen them)
        self.file_fds: list[int] = []  # FILE entries' record files, kept open
        if authorization is not None:
            reply = self.hello(authorization)
            assert reply.status == lw.Status.OK, reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        for fd in [*self.fds, *self.segment_fds.values(), *self.file_fds]:
            with contextlib.suppress(OSError):
                os.close(fd)
        for m in self.segments.values():
            with contextlib.suppress(BufferError):
                m.close()

    def __enter__(self) -> RawLocal:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- bytes ------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k, ancillary, _flags, _ = self.sock.recvmsg_into([view[got:]], ANCILLARY)
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(data[: len(data) - len(data) % 4])
                    self.fds.extend(fds)
            if not k:
                raise ConnectionError(f"closed after {got} of {n} bytes")
            got += k
        return bytes(buf)

    def closed_by_tier(self) -> bool:
        """Whether the tier has closed this connection (checked without waiting)."""
        self.sock.settimeout(0.0)
        try:
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True
        finally:
            self.sock.settimeout(10.0)

    # -- messages ---------------------------------------------------------------------

    def request(self, op: int, table: bytes = b"", count: int = 0, flags: int = 0) -> None:
        self.send(lw.request(Op(op), count, len(table), flags) + table)

    def reply(self) -> Reply:
        magic, version, op, status, count, extra, text_len = lw.REPLY.unpack(self.recv(lw.REPLY.size))
        assert (magic, version) == (lw.MAGIC, lw.VERSION), (magic, version)
        text = self.recv(text_len).decode() if text_len else ""
        return Reply(op, status, count, extra, text)

    def hello(self, authorization: str) -> Reply:
        self.request(Op.HELLO, authorization.encode())
        return self.reply()

    def get(self, keys: list[bytes], flags: int = 0) -> tuple[Reply, list[Entry]]:
        """A GET: the reply and its entries (inline values read); new segments mapped."""
        self.request(Op.GET, lw.key_table(keys), len(keys), flags)
        return self.read_get_reply()

    def read_get_reply(self) -> tuple[Reply, list[Entry]]:
        """The reply to a GET sent before (``request``), as ``get`` reads it."""
        reply = self.reply()
        if reply.status != lw.Status.OK:
            return reply, []
        records = self.recv(reply.extra * lw.SEGMENT.size)
        for i in range(reply.extra):
            segment, size = lw.SEGMENT.unpack_from(records, i * lw.SEGMENT.size)
            fd = self.fds.pop(0)
            self.segment_fds[segment] = fd
            self.segments[segment] = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        raw = self.recv(reply.count * lw.ENTRY.size)
        entries = [Entry(*lw.ENTRY.unpack_from(raw, i * lw.ENTRY.size)) for i in range(reply.count)]
        out = []
        for e in entries:
            inline = self.recv(e.length) if e.place == Place.INLINE else b""
            fd = -1
            if e.place == Place.FILE:
                fd = self.fds.pop(0)
                self.file_fds.append(fd)
            out.append(Entry(e.place, e.segment, e.offset, e.length, e.checksum, inline, fd))
        return reply, out

    def read(self, entry: Entry) -> bytes:
        """An entry's value: its inline bytes, read from its record file, or a copy out of
        its segment."""
        if entry.place == Place.INLINE:
            return entry.inline
        if entry.place == Place.FILE:
            return os.pread(entry.fd, entry.length, entry.offset + entry.segment)
        return bytes(self.segments[entry.segment][entry.offset : entry.offset + entry.length])

    def release(self) -> None:
        self.request(Op.RELEASE)

    def stage(self, size: int) -> tuple[Reply, int | None]:
        """STAGE: the reply and the staging segment's (writable) fd."""
        self.request(Op.STAGE, lw.STAGE.pack(size))
        reply = self.reply()
        return reply, (self.fds.pop(0) if reply.status == lw.Status.OK else None)

    def put(self, items: list[tuple[bytes, int, int, int]], flags: int = 0) -> Reply:
        """PUT of values already in the staging segment: (key, offset, length, checksum);
        with ``FLAG_RESERVED``, in reservations: (key, reservation index, length, checksum)."""
        self.request(Op.PUT, lw.put_table(items), len(items), flags)
        return self.reply()

    def reserve(self, sizes: list[int]) -> tuple[Reply, list[tuple[int, int]]]:
        """RESERVE: the reply and each reservation's (segment, offset); the segments handed
        over are mapped read-write (``segments``, their fds in ``segment_fds``)."""
        self.request(Op.RESERVE, b"".join(lw.RESERVE_ITEM.pack(n) for n in sizes), len(sizes))
        reply = self.reply()
        if reply.status != lw.Status.OK:
            return reply, []
        records = self.recv(reply.extra * lw.SEGMENT.size)
        for segment, size in lw.SEGMENT.iter_unpack(records):
            fd = self.fds.pop(0)
            self.segment_fds[segment] = fd
            self.segments[segment] = mmap.mmap(fd, size)
        return reply, list(lw.PLACE.iter_unpack(self.recv(reply.count * lw.PLACE.size)))

    def write(self, place: tuple[int, int], data: bytes) -> None:
        """Writes ``data`` into a reservation (``reserve``'s place)."""
        segment, offset = place
        self.segments[segment][offset : offset + len(data)] = data
