"""The hand-written frame codec speaks exactly the protobuf wire format of cache.proto."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.proto import cache_pb2, wire

u64 = st.integers(min_value=0, max_value=2**64 - 1)
u32 = st.integers(min_value=0, max_value=2**32 - 1)


@given(index=u32, found=st.booleans(), total=u64, offset=u64, data=st.binary(max_size=300))
def test_hand_encoded_get_frames_parse_as_the_generated_message(
    index: int, found: bool, total: int, offset: int, data: bytes
) -> None:
    raw = wire.encode_get_frame(index, found, total, offset, data)
    m = cache_pb2.GetFrame.FromString(raw)
    assert (m.index, m.found, m.total_length, m.offset, m.data) == (index, found, total, offset, data)
    assert raw == m.SerializeToString()


@given(index=u32, found=st.booleans(), total=u64, offset=u64, data=st.binary(max_size=300))
def test_generated_get_frames_decode_by_hand(index: int, found: bool, total: int, offset: int, data: bytes) -> None:
    raw = cache_pb2.GetFrame(index=index, found=found, total_length=total, offset=offset, data=data).SerializeToString()
    f = wire.decode_get_frame(raw)
    assert (f.index, f.found, f.total_length, f.offset, bytes(f.data)) == (index, found, total, offset, data)


@given(key=st.binary(max_size=300), total=u64, offset=u64, parts=st.lists(st.binary(max_size=100), max_size=4))
def test_hand_encoded_put_frames_parse_as_the_generated_message(
    key: bytes, total: int, offset: int, parts: list[bytes]
) -> None:
    raw = wire.encode_put_frame(key, total, offset, *parts)
    m = cache_pb2.PutFrame.FromString(raw)
    assert (m.key, m.total_length, m.offset, m.data) == (key, total, offset, b"".join(parts))
    f = wire.decode_put_frame(raw)
    assert (f.key, f.total_length, f.offset, bytes(f.data)) == (key, total, offset, b"".join(parts))


def test_decoded_payloads_are_views_into_the_message_not_copies() -> None:
    raw = wire.encode_get_frame(1, True, 5, 0, b"hello")
    f = wire.decode_get_frame(raw)
    assert f.data.obj is raw


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x0a\x05ab", "runs past the end"),
        (b"\x10", "truncated varint"),
        (b"\x28\x01", "unknown field number 5"),
        (b"\x0a\x01a\x7d\x00\x00\x00\x00", "wire type 5"),  # field 15 as fixed32
        (b"\x10" + b"\xff" * 11, "varint too long"),
    ],
)
def test_malformed_put_frames_raise_a_wire_error_naming_the_problem(raw: bytes, message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.decode_put_frame(raw)


@given(st.binary(max_size=64))
def test_random_bytes_either_decode_or_raise_a_wire_error(raw: bytes) -> None:
    for decode in (wire.decode_put_frame, wire.decode_get_frame):
        with contextlib.suppress(wire.WireError):
            decode(raw)
