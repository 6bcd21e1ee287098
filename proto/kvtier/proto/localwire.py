"""The same-node transport's wire format: control messages on a Unix socket, values in shared memory.

When an engine and its tier share a node, the tier (``kvtier server --local-socket``)
keeps its RAM tier's values in memfd segments and hands the client read-only file
descriptors of them over a Unix stream socket (``SCM_RIGHTS``); only control messages
cross the socket (docs/protocol.md, "Same-node transport"). Both ends import their
headers, codes and the value checksum from here (the server from
``kvtier.cacheserver.localport``, the client from ``kvtier.connector.client.local``)::

    request  REQUEST: magic "KVTL" | version u8 | op u8 | flags u16 | count u32 | table_len u32
             then table_len bytes of table
    reply    REPLY: magic "KVTL" | version u8 | op u8 | status u16 | count u32 | extra u32 | text_len u32
             then text_len bytes of UTF-8 text (an error's message; HELLO: the caller's tenant),
             then the op's body

    HELLO    table: the authorization value ("Bearer <token>", UTF-8; may be empty)
             -> OK, text: the caller's tenant
    LOOKUP   table: count x (key_len u16, key) -> OK, count: the present prefix's length
    DELETE   table: count x (key_len u16, key) -> OK, count: keys deleted
    STATS    no table -> OK, extra: body length; body: a kvtier.v1 StatsResponse message
    GET      table: count x (key_len u16, key); flags bit 0: stop at the first miss;
             bit 1: the client reads disk-tier record files itself (FILE entries)
             -> OK, count: entries, extra: segments handed over (their fds ride on this reply);
             body: extra x SEGMENT, then count x ENTRY (the fds of its FILE entries ride on
             it, in order), then the INLINE values back to back.
             The SHARED values of the reply are leased to the connection until RELEASE.
    RELEASE  no table, no reply: ends the connection's lease (the client copied its values)
    STAGE    table: size u64 -> OK, one fd (a writable memfd of that size: the connection's
             staging segment, replacing any earlier one)
    PUT      table: count x PUT_ITEM, each followed by its key: values already written into
             the staging segment at offset..offset+length, with their checksums
             -> OK, count: values stored, extra: values rejected for capacity
             flags bit 2 (FLAG_RESERVED): each value was written into its reservation
             instead (PUT_ITEM's offset: the reservation's index in the last RESERVE, its
             length the size reserved); each reservation is stored once
    RESERVE  table: count x RESERVE_ITEM (a value's size) -> OK, count: count (reserved) or
             0 (no room now: STAGE and PUT from the staging segment instead), extra:
             segments handed over (read-write: the caller's tenant's own; their fds ride on
             this reply); body: extra x SEGMENT, then count x PLACE. Replaces the
             connection's earlier reservations; they last until stored or the connection ends.

``status`` is a gRPC status code number (``Status``, the data port's). The checksum of a
value is xxh3-64 of its bytes (``checksum``), computed by the side that writes it while it
copies (``copy_checked``) and checked by the side that reads it.
"""

from __future__ import annotations

import enum
import errno
import os
import struct
from types import ModuleType

import xxhash
from typing_extensions import Buffer

from kvtier.proto.datawire import Status

_copyhash: ModuleType | None
try:  # the C helper (proto/kvtier/proto/_copyhash.c), built by pip when a compiler is at hand
    from kvtier.proto import _copyhash
except ImportError:  # pragma: no cover - exercised where the helper is not built
    _copyhash = None

__all__ = [
    "ENTRY",
    "FLAG_FILES",
    "FLAG_RESERVED",
    "FLAG_STOP_AT_FIRST_MISS",
    "KEY",
    "MAGIC",
    "MAX_FDS",
    "MAX_HELLO_BYTES",
    "MAX_TABLE_BYTES",
    "PLACE",
    "PUT_ITEM",
    "REPLY",
    "REQUEST",
    "RESERVE_ITEM",
    "SEGMENT",
    "STAGE",
    "VERSION",
    "Op",
    "Place",
    "Status",
    "checksum",
    "copy_checked",
    "copy_checked_py",
    "copy_streamed",
    "key_table",
    "put_table",
    "read_checked",
    "read_checked_py",
    "reply",
    "request",
]

MAGIC = b"KVTL"
VERSION = 1
REQUEST = struct.Struct("<4sBBHII")  # 16 bytes
REPLY = struct.Struct("<4sBBHIII")  # 20 bytes
KEY = struct.Struct("<H")
PUT_ITEM = struct.Struct("<HQQQ")  # key_len, staging offset, length, checksum
SEGMENT = struct.Struct("<IQ")  # segment id, size
ENTRY = struct.Struct("<BxxxIQQQ")  # place, segment id, offset, length, checksum
STAGE = struct.Struct("<Q")
RESERVE_ITEM = struct.Struct("<Q")  # a value's size
PLACE = struct.Struct("<IQ")  # segment id, offset: where a reservation lies

FLAG_STOP_AT_FIRST_MISS = 1
FLAG_FILES = 2
FLAG_RESERVED = 4
MAX_TABLE_BYTES = 64 << 20
MAX_HELLO_BYTES = 8 << 10
MAX_FDS = 250  # file descriptors per sendmsg (the kernel's limit is 253)
# Values are copied and hashed in blocks of this size: each block is hashed while it is
# still in the CPU's cache, so the checksum costs little more than the copy.
BLOCK = 256 << 10


class Op(enum.IntEnum):
    HELLO = 1
    LOOKUP = 2
    GET = 3
    PUT = 4
    DELETE = 5
    STATS = 6
    STAGE = 7
    RELEASE = 8
    RESERVE = 9


class Place(enum.IntEnum):
    """Where a GET entry's value is."""

    MISSING = 0
    SHARED = 1  # in a segment: copy it out (under the connection's lease)
    INLINE = 2  # its bytes follow the reply on the socket (a small value, or one not in a segment)
    # In a disk-tier record file whose read-only fd rides on the entries (FLAG_FILES): the
    # entry's offset is where the record's key starts, its segment field the key's length,
    # then length bytes of value; checksum: xxh3-64 of key and value (the record's own).
    FILE = 3


def request(op: Op, count: int = 0, table_len: int = 0, flags: int = 0) -> bytes:
    return REQUEST.pack(MAGIC, VERSION, op, flags, count, table_len)


def reply(op: int, status: Status, count: int = 0, extra: int = 0, text: str = "") -> bytes:
    raw = text.encode()
    return REPLY.pack(MAGIC, VERSION, op, status, count, extra, len(raw)) + raw


def key_table(keys: list[bytes]) -> bytes:
    return b"".join(KEY.pack(len(k)) + k for k in keys)


def put_table(items: list[tuple[bytes, int, int, int]]) -> bytes:
    """``items``: (key, staging offset, length, checksum)."""
    return b"".join(PUT_ITEM.pack(len(k), o, n, c) + k for k, o, n, c in items)


def checksum(value: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(value)


def copy_checked(dst: memoryview, *sources: memoryview) -> int:
    """Copies ``sources`` back to back into ``dst`` (of their total length) and returns the
    checksum of what landed in ``dst``, each block hashed right after it is copied. In C
    without the GIL where ``_copyhash`` is built (fast at any alignment, and in one pass of
    copy and hash where the CPU has AVX2; docs/benchmarks.md, "Same-node copies and
    alignment"), else ``copy_checked_py``."""
    if _copyhash is not None:
        got: int = _copyhash.copy_checked(dst, *sources)
        return got
    return copy_checked_py(dst, *sources)


def copy_streamed(dst: memoryview, *sources: memoryview) -> int:
    """``copy_checked`` for a destination another process reads later (a PUT into an extent
    the tier reserved): each block is hashed in the sources, then copied with non-temporal
    stores that skip reading the destination into cache first (docs/benchmarks.md, "Same-node
    copies and alignment"). The checksum is of the bytes read from the sources, which the
    caller owns. ``copy_checked_py`` where ``_copyhash`` is not built."""
    if _copyhash is not None:
        got: int = _copyhash.copy_streamed(dst, *sources)
        return got
    return copy_checked_py(dst, *sources)


def copy_checked_py(dst: memoryview, *sources: memoryview) -> int:
    """``copy_checked`` in pure Python: a memoryview slice assignment per block."""
    total = sum(src.nbytes for src in sources)
    if dst.nbytes != total:
        raise ValueError(f"copy of {total} bytes into {dst.nbytes}")
    h = xxhash.xxh3_64()
    pos = 0
    for src in sources:
        n = src.nbytes
        for offset in range(0, n, BLOCK):
            end = min(n, offset + BLOCK)
            part = dst[pos + offset : pos + end]
            part[:] = src[offset:end]
            h.update(part)
        pos += n
    return h.intdigest()


def read_checked(fd: int, offset: int, dst: memoryview, prefix_len: int) -> int:
    """Reads ``prefix_len`` bytes of file ``fd`` at ``offset`` (hashed, not kept), then
    ``dst.nbytes`` more into ``dst``, and returns the xxh3-64 of all of them, each block
    hashed right after it is read. OSError on a read error, EOFError when the file ends
    first. In C without the GIL where ``_copyhash`` is built, else ``read_checked_py``."""
    if _copyhash is not None:
        got: int = _copyhash.read_checked(fd, offset, dst, prefix_len)
        return got
    return read_checked_py(fd, offset, dst, prefix_len)


def read_checked_py(fd: int, offset: int, dst: memoryview, prefix_len: int) -> int:
    """``read_checked`` in pure Python: ``os.preadv`` per block."""
    if fd < 0 or offset < 0 or not 0 <= prefix_len <= 0xFFFF:
        raise ValueError(f"read_checked: fd {fd}, offset {offset}, prefix_len {prefix_len}")
    dst = memoryview(dst).cast("B")
    if dst.readonly:
        raise BufferError("Object is not writable.")
    h = xxhash.xxh3_64()
    head = bytearray(prefix_len)
    _pread_full(fd, memoryview(head), offset)
    h.update(head)
    pos = offset + prefix_len
    for start in range(0, dst.nbytes, BLOCK):
        part = dst[start : start + BLOCK]
        _pread_full(fd, part, pos)
        h.update(part)
        pos += part.nbytes
    return h.intdigest()


def write_checked(fd: int, offset: int, src: Buffer, prefix: bytes) -> tuple[int, int]:
    """Writes ``prefix`` then ``src`` to file ``fd`` at ``offset`` and returns the xxh3-64 of
    ``src`` and of ``prefix + src`` *as written*: each block of ``src`` is copied aside,
    hashed there and written from there, so a ``src`` that another process changes
    meanwhile (a same-node client's staging segment) cannot make the file differ from what
    was hashed. OSError on a write error. In C without the GIL where ``_copyhash`` is built,
    else ``write_checked_py``."""
    if _copyhash is not None:
        got: tuple[int, int] = _copyhash.write_checked(fd, offset, src, prefix)
        return got
    return write_checked_py(fd, offset, src, prefix)


def write_checked_py(fd: int, offset: int, src: Buffer, prefix: bytes) -> tuple[int, int]:
    """``write_checked`` in pure Python: a block copied into a ``bytearray``, ``os.pwrite``."""
    if fd < 0 or offset < 0 or len(prefix) > 0xFFFF:
        raise ValueError(f"write_checked: fd {fd}, offset {offset}, a prefix of {len(prefix)} bytes")
    view = memoryview(src).cast("B")
    value, whole = xxhash.xxh3_64(), xxhash.xxh3_64(prefix)
    pwrite_all(fd, prefix, offset)
    pos = offset + len(prefix)
    block = bytearray(min(BLOCK, view.nbytes))
    start = 0
    while start < view.nbytes:
        n = min(BLOCK - pos % BLOCK, view.nbytes - start)  # blocks end at multiples of BLOCK in the file
        part = memoryview(block)[:n]
        part[:] = view[start : start + n]
        value.update(part)
        whole.update(part)
        pwrite_all(fd, part, pos)
        pos += n
        start += n
    return value.intdigest(), whole.intdigest()


def pwrite_all(fd: int, data: Buffer, pos: int) -> None:
    """``os.pwrite`` of all of ``data`` at ``pos`` (a short write continues)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < view.nbytes:
        n = os.pwrite(fd, view[done:], pos + done)
        if n == 0:  # no progress: never loop on it
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {pos + done}")
        done += n


def _pread_full(fd: int, view: memoryview, pos: int) -> None:
    got = 0
    while got < view.nbytes:
        n = os.preadv(fd, [view[got:]], pos + got)
        if not n:
            raise EOFError(f"read_checked: the file ended at offset {pos + got}")
        got += n
