"""The data port's wire format: fixed little-endian headers, then raw bytes.

The data port (docs/protocol.md, "Data port") moves Get and Put values on a
plain TCP (or TLS) stream beside the gRPC port, so that a value crosses no
message framing: the receiver reads it straight into the buffer that keeps it.
Both ends import their headers and codes from here (the server from
``kvtier.cacheserver.dataport``, the client from ``kvtier.connector.client.dataport``)::

    request  REQUEST: magic "KVTD" | version u8 | op u8 | flags u16 | count u32 | table_len u32
             then table_len bytes of table:
               HELLO  the caller's authorization value ("Bearer <token>", UTF-8; may be empty)
               GET    count x (key_len u16, key)
               PUT    count x (key_len u16, value_len u64, key)
    reply    REPLY: magic "KVTD" | version u8 | op u8 | status u16 | count u32 | extra u32 | text_len u32
             then text_len bytes of UTF-8 text (an error's message; HELLO: the caller's tenant)

    GET  request -> reply (OK: count = keys asked for), then one ENTRY per key in order
         (found u8 | value_len u64, then value_len bytes when found); with
         FLAG_STOP_AT_FIRST_MISS the entries end at the first miss (its entry included).
    PUT  request -> reply (OK: "send the values") -> the values' bytes back to back
         -> reply (OK: count = values stored, extra = values rejected for capacity).

``status`` is a gRPC status code number (``Status``), so both paths report the
same codes. An error reply ends the request; the server closes the connection
after it when the stream can no longer be parsed (bad magic, version or op, an
oversized table, a cut or stalled request) or the caller is unauthenticated.
"""

from __future__ import annotations

import enum
import struct

MAGIC = b"KVTD"
VERSION = 1
REQUEST = struct.Struct("<4sBBHII")  # 16 bytes
REPLY = struct.Struct("<4sBBHIII")  # 20 bytes
GET_KEY = struct.Struct("<H")
PUT_ITEM = struct.Struct("<HQ")
ENTRY = struct.Struct("<BQ")

FLAG_STOP_AT_FIRST_MISS = 1
# A request's table (keys, or the authorization value) is at most this large;
# a larger one is treated as a stream that cannot be parsed.
MAX_TABLE_BYTES = 64 << 20
MAX_HELLO_BYTES = 8 << 10


class Op(enum.IntEnum):
    HELLO = 1
    GET = 2
    PUT = 3


class Status(enum.IntEnum):
    """The gRPC status codes the data port answers with (same numbers as gRPC's)."""

    OK = 0
    CANCELLED = 1
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    RESOURCE_EXHAUSTED = 8
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


def request(op: Op, count: int, table_len: int, flags: int = 0) -> bytes:
    return REQUEST.pack(MAGIC, VERSION, op, flags, count, table_len)


def reply(op: int, status: Status, count: int = 0, extra: int = 0, text: str = "") -> bytes:
    raw = text.encode()
    return REPLY.pack(MAGIC, VERSION, op, status, count, extra, len(raw)) + raw


def get_table(keys: list[bytes]) -> bytes:
    return b"".join(GET_KEY.pack(len(k)) + k for k in keys)


def put_table(items: list[tuple[bytes, int]]) -> bytes:
    return b"".join(PUT_ITEM.pack(len(k), n) + k for k, n in items)
