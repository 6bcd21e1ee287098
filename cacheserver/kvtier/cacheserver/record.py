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

import struct

import xxhash
from typing_extensions import Buffer

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
    n = memoryview(value).nbytes
    return HEADER.pack(MAGIC, VERSION, 0, len(key), n, checksum(key, value)) + key


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
