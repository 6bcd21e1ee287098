"""Hand-written encoders/decoders for the two messages that carry values.

``GetFrame`` and ``PutFrame`` carry chunk payloads of megabytes. The generated
protobuf classes copy a payload on every parse, construction and
serialization; these functions produce and read the very same wire bytes
(checked against the generated classes by tests/proto/test_wire.py) with one
copy on encode (joining the small header and the payload) and none on decode
(the payload is a memoryview into the received message).

Decoding is strict: an unknown field number or a wrong wire type raises
``WireError`` naming the field, so a client built against a newer contract
gets a clear INVALID_ARGUMENT instead of a silently ignored field.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing_extensions import Buffer

_VARINT = 0
_LEN = 2

# Room kept for a frame's fields besides its data (a key, lengths, tags), so a
# frame of ``frame_bytes`` on the wire carries ``frame_bytes - FRAME_OVERHEAD``
# data bytes. With the default 4 MiB, frames fit gRPC's default 4 MiB receive
# limit, so any gRPC client can read them.
FRAME_OVERHEAD = 2048


class WireError(ValueError):
    """A frame is malformed; the message names the field."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int, what: str) -> tuple[int, int]:
    result = 0
    shift = 0
    end = len(buf)
    while True:
        if pos >= end:
            raise WireError(f"{what}: truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            if result >= 1 << 64:
                raise WireError(f"{what}: varint out of range")
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError(f"{what}: varint too long")


# Tags (field number << 3 | wire type), pre-encoded.
_T_GET_INDEX = _varint(1 << 3 | _VARINT)
_T_GET_FOUND = _varint(2 << 3 | _VARINT)
_T_TOTAL = _varint(3 << 3 | _VARINT)
_T_OFFSET = _varint(4 << 3 | _VARINT)
_T_DATA = _varint(15 << 3 | _LEN)
_T_PUT_KEY = _varint(1 << 3 | _LEN)
_T_PUT_TOTAL = _varint(2 << 3 | _VARINT)
_T_PUT_OFFSET = _varint(3 << 3 | _VARINT)


def _parse(buf: Buffer, message: str, fields: dict[int, int]) -> dict[int, int | memoryview]:
    """Parses a flat message of varint and length-delimited fields (last one wins)."""
    view = memoryview(buf).cast("B")
    out: dict[int, int | memoryview] = {}
    pos = 0
    end = len(view)
    while pos < end:
        tag, pos = _read_varint(view, pos, message)
        number, wire_type = tag >> 3, tag & 7
        expected = fields.get(number)
        if expected is None:
            raise WireError(f"{message}: unknown field number {number} (this server knows {sorted(fields)})")
        if wire_type != expected:
            raise WireError(f"{message}: field {number} has wire type {wire_type}, expected {expected}")
        if wire_type == _VARINT:
            out[number], pos = _read_varint(view, pos, message)
        else:
            length, pos = _read_varint(view, pos, message)
            if pos + length > end:
                raise WireError(f"{message}: field {number} runs past the end of the message")
            out[number] = view[pos : pos + length]
            pos += length
    return out


# -- GetFrame (server -> client) -------------------------------------------------


@dataclass(frozen=True)
class GetFrame:
    index: int
    found: bool
    total_length: int
    offset: int
    data: memoryview


def encode_get_frame(index: int, found: bool, total_length: int, offset: int, data: Buffer) -> bytes:
    parts: list[Buffer] = []
    if index:
        parts += [_T_GET_INDEX, _varint(index)]
    if found:
        parts += [_T_GET_FOUND, b"\x01"]
    if total_length:
        parts += [_T_TOTAL, _varint(total_length)]
    if offset:
        parts += [_T_OFFSET, _varint(offset)]
    n = memoryview(data).nbytes
    if n:
        parts += [_T_DATA, _varint(n), data]
    return b"".join(parts)


_GET_FIELDS = {1: _VARINT, 2: _VARINT, 3: _VARINT, 4: _VARINT, 15: _LEN}


def decode_get_frame(buf: Buffer) -> GetFrame:
    f = _parse(buf, "GetFrame", _GET_FIELDS)
    data = f.get(15, memoryview(b""))
    assert isinstance(data, memoryview)
    return GetFrame(
        index=_int(f, 1), found=bool(_int(f, 2)), total_length=_int(f, 3), offset=_int(f, 4), data=data
    )


# -- PutFrame (client -> server) -------------------------------------------------


@dataclass(frozen=True)
class PutFrame:
    key: bytes
    total_length: int
    offset: int
    data: memoryview


def encode_put_frame(key: bytes, total_length: int, offset: int, *data: Buffer) -> bytes:
    """A PutFrame whose data is the concatenation of ``data`` (joined once, here)."""
    parts: list[Buffer] = []
    if key:
        parts += [_T_PUT_KEY, _varint(len(key)), key]
    if total_length:
        parts += [_T_PUT_TOTAL, _varint(total_length)]
    if offset:
        parts += [_T_PUT_OFFSET, _varint(offset)]
    n = sum(memoryview(d).nbytes for d in data)
    if n:
        parts += [_T_DATA, _varint(n), *data]
    return b"".join(parts)


_PUT_FIELDS = {1: _LEN, 2: _VARINT, 3: _VARINT, 15: _LEN}


def decode_put_frame(buf: Buffer) -> PutFrame:
    f = _parse(buf, "PutFrame", _PUT_FIELDS)
    key = f.get(1, memoryview(b""))
    data = f.get(15, memoryview(b""))
    assert isinstance(key, memoryview) and isinstance(data, memoryview)
    return PutFrame(key=bytes(key), total_length=_int(f, 2), offset=_int(f, 3), data=data)


def _int(fields: dict[int, int | memoryview], number: int) -> int:
    v = fields.get(number, 0)
    assert isinstance(v, int)
    return v


def identity(b: bytes) -> bytes:
    """A (de)serializer that hands the raw message bytes through."""
    return b
