"""The at-rest record: how the disk and Redis tiers store one value.

A record is a 24-byte header, the namespaced key, then the value::

    magic "KVTR" | version u8 | flags u8 | key length u16 | value length u64 | checksum u64
    key bytes | value bytes

The checksum is xxh3-64 over key and value. Storing the key inside the record
lets a reader detect a record that sits under the wrong name (a swapped file or
Redis value), not only flipped bits or truncation. A record that fails any
check raises ``CorruptRecord``; the tier deletes it and counts a verification
failure, and the lookup is a miss.
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass

import xxhash
from typing_extensions import Buffer

from kvtier.cacheserver import nowait

MAGIC = b"KVTR"
VERSION = 1
HEADER = struct.Struct("<4sBBHQQ")
HEADER_SIZE = HEADER.size  # 24


class CorruptRecord(Exception):
    """A stored record failed verification (the message says which check)."""


def checksum(key: bytes, value: Buffer) -> int:
    h = xxhash.xxh3_64(key)
    h.update(value)
    return h.intdigest()


def header(key: bytes, value: Buffer) -> bytes:
    """The header and key that precede ``value`` in a record (the value itself is not copied)."""
    return head(key, memoryview(value).nbytes, checksum(key, value)) + key


def head(key: bytes, value_len: int, crc: int) -> bytes:
    """The 24-byte header of a record of ``key`` and a value of ``value_len`` bytes whose
    checksum (``checksum``: key, then value) is ``crc``."""
    return HEADER.pack(MAGIC, VERSION, 0, len(key), value_len, crc)


def encode(key: bytes, value: Buffer) -> bytes:
    return header(key, value) + bytes(value)


def parse_header(head: bytes | memoryview) -> tuple[bytes, int, int]:
    """Returns (stored key, value length, checksum) from the first bytes of a record."""
    if len(head) < HEADER_SIZE:
        raise CorruptRecord(f"record shorter than its {HEADER_SIZE}-byte header")
    magic, version, _flags, key_len, value_len, crc = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise CorruptRecord("bad magic")
    if version != VERSION:
        raise CorruptRecord(f"unknown record version {version}")
    if len(head) < HEADER_SIZE + key_len:
        raise CorruptRecord("record truncated inside its key")
    return bytes(head[HEADER_SIZE : HEADER_SIZE + key_len]), value_len, crc


def decode(key: bytes, record: bytes | memoryview) -> memoryview:
    """Verifies a whole record stored under ``key`` and returns its value (no copy)."""
    stored_key, value_len, crc = parse_header(record)
    if stored_key != key:
        raise CorruptRecord("record belongs to another key")
    start = HEADER_SIZE + len(stored_key)
    view = memoryview(record)
    if len(view) - start != value_len:
        raise CorruptRecord(f"value length {len(view) - start} != recorded {value_len}")
    value = view[start:]
    if checksum(key, value) != crc:
        raise CorruptRecord("checksum mismatch")
    return value


@dataclass
class RecordFile:
    """A record file opened read-only, its header checked against the key and the file's
    size but its key and value not read: a same-node client reads them itself and checks
    ``checksum`` (xxh3-64 of the ``key_len`` bytes at ``HEADER_SIZE`` and the
    ``value_len`` after them). The disk tier never rewrites a record file in place
    (written aside, renamed), so the descriptor's bytes stay the record's."""

    fd: int
    key_len: int
    value_len: int
    checksum: int

    @property
    def nbytes(self) -> int:
        return self.value_len

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)


def open_file(path: str | os.PathLike[str], key: bytes) -> RecordFile:
    """Opens the record of ``key`` at ``path`` and checks its header: the stored key, and
    the value length against the file's size. Raises CorruptRecord, or OSError
    (FileNotFoundError when there is no such file)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        head = os.pread(fd, HEADER_SIZE + len(key), 0)
    except BaseException:
        os.close(fd)
        raise
    return _checked(fd, key, head)


def open_file_nowait(path: str | os.PathLike[str], key: bytes) -> RecordFile | None:
    """``open_file`` if it needs no I/O (the path in the dentry cache, the header in the
    page cache: ``kvtier.cacheserver.nowait``), else None: then ``open_file`` in a thread."""
    fd = nowait.open_cached(path)
    if fd is None:
        return None
    head = bytearray(HEADER_SIZE + len(key))
    try:
        n = os.preadv(fd, [head], 0, os.RWF_NOWAIT)
    except OSError:  # EAGAIN: not in the page cache; EOPNOTSUPP: a file system without it
        n = -1
    except BaseException:
        os.close(fd)
        raise
    if n != len(head):  # not all in the page cache (or a short file: open_file judges)
        os.close(fd)
        return None
    return _checked(fd, key, bytes(head))


def _checked(fd: int, key: bytes, head: bytes) -> RecordFile:
    """The open record ``fd`` whose first bytes are ``head``, checked (closed if it fails)."""
    try:
        stored_key, value_len, crc = parse_header(head)
        if stored_key != key:
            raise CorruptRecord("record belongs to another key")
        size = os.fstat(fd).st_size
        if size != HEADER_SIZE + len(key) + value_len:
            raise CorruptRecord(f"file of {size} bytes, its header says {value_len} of value")
        return RecordFile(fd, len(key), value_len, crc)
    except BaseException:
        os.close(fd)
        raise
