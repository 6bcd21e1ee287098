"""The chunk codec: round trips without copies, and every corruption is one typed error."""

from __future__ import annotations

import math
import struct
from array import array

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.connector.chunks.codec import (
    DTYPE_SIZES,
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    decode_chunk,
    encode_chunk,
    encode_chunk_bytes,
)
from kvtier.connector.chunks.keys import KeySpec, chunk_keys
from kvtier.connector.errors import (
    CHUNK_ERROR_REASONS,
    ChunkDecodeError,
    ConfigError,
    ConnectorError,
)

UNTIMED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""Hypothesis without its clocks: on a shared, loaded machine a slow example is load, not a bug."""

KEY = chunk_keys(range(256), [], KeySpec("tiny"))[0]
OTHER_KEY = chunk_keys(range(1, 257), [], KeySpec("tiny"))[0]
SHAPE = (2, 3, 4)  # 24 bfloat16 values
PAYLOAD = bytes(range(48))

# Format version 1 of PAYLOAD under b"pinned-key" as bfloat16 (2, 3, 4): changing
# the header layout without bumping FORMAT_VERSION fails test_the_header_format_is_pinned.
PINNED_HEADER = (
    "4b5654430100"  # magic, version 1, codec 0 (raw)
    "4a00"  # header size 74
    "15c9d8d1fe920224cec6aafbcc49f7f1"  # key fingerprint
    "3000000000000000"  # payload size 48
    "0862666c6f61743136"  # dtype "bfloat16"
    "03"
    "0200000000000000"
    "0300000000000000"
    "0400000000000000"  # shape (2, 3, 4)
    "182827955fee8d9d"  # checksum
)


def reseal(blob: bytearray) -> bytearray:
    """Recompute the checksum after editing a header, to reach the checks behind it."""
    header_size = struct.unpack_from("<H", blob, 6)[0]
    checksum = xxhash.xxh3_64(bytes(blob[: header_size - 8]) + bytes(blob[header_size:]))
    struct.pack_into("<Q", blob, header_size - 8, checksum.intdigest())
    return blob


@UNTIMED
@given(
    st.sampled_from(sorted(DTYPE_SIZES)),
    st.lists(st.integers(0, 5), max_size=4).map(tuple),
    st.binary(min_size=1, max_size=64),
)
def test_a_chunk_decodes_to_what_was_encoded(
    dtype: str, shape: tuple[int, ...], key: bytes
) -> None:
    payload = bytes(range(256)) * (1 + math.prod(shape) * DTYPE_SIZES[dtype] // 256)
    payload = payload[: math.prod(shape) * DTYPE_SIZES[dtype]]
    chunk = decode_chunk(key, encode_chunk_bytes(key, payload, dtype=dtype, shape=shape))
    assert (chunk.dtype, chunk.shape, chunk.codec) == (dtype, shape, "raw")
    assert chunk.payload == payload


def test_encoding_returns_a_view_of_the_payload_not_a_copy() -> None:
    payload = bytearray(PAYLOAD)
    header, body = encode_chunk(KEY, payload, dtype="bfloat16", shape=SHAPE)
    payload[0] = 0xFF
    assert memoryview(body).obj is payload
    assert memoryview(body)[0] == 0xFF
    assert memoryview(header).nbytes < 128


def test_encoding_accepts_typed_buffers_by_their_bytes() -> None:
    payload = array("H", range(24))
    frames = encode_chunk(KEY, payload, dtype="bfloat16", shape=SHAPE)
    assert decode_chunk(KEY, b"".join(frames)).payload == payload.tobytes()


def test_decoding_returns_a_view_into_the_blob_not_a_copy() -> None:
    blob = encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE)
    assert decode_chunk(KEY, blob).payload.obj is blob


def test_the_joined_frames_are_the_chunk_bytes() -> None:
    frames = encode_chunk(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE)
    assert b"".join(frames) == encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE)


def test_an_empty_payload_round_trips() -> None:
    blob = encode_chunk_bytes(KEY, b"", dtype="int8", shape=(0, 16))
    assert decode_chunk(KEY, blob).shape == (0, 16)


def test_the_header_format_is_pinned() -> None:
    header, _ = encode_chunk(b"pinned-key", PAYLOAD, dtype="bfloat16", shape=SHAPE)
    assert FORMAT_VERSION == 1
    assert bytes(header).hex() == PINNED_HEADER


def test_every_truncation_is_a_decode_error() -> None:
    blob = encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE)
    for size in range(len(blob)):
        with pytest.raises(ChunkDecodeError):
            decode_chunk(KEY, blob[:size])


def test_trailing_bytes_are_a_decode_error() -> None:
    blob = encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE)
    with pytest.raises(ChunkDecodeError, match="length"):
        decode_chunk(KEY, blob + b"\x00")


def test_every_flipped_bit_is_a_decode_error() -> None:
    blob = encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE)
    for bit in range(len(blob) * 8):
        corrupt = bytearray(blob)
        corrupt[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ChunkDecodeError):
            decode_chunk(KEY, corrupt)


def test_a_chunk_of_another_key_is_a_decode_error() -> None:
    blob = encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE)
    with pytest.raises(ChunkDecodeError, match="another key"):
        decode_chunk(OTHER_KEY, blob)


def test_a_wrong_checksum_is_a_decode_error() -> None:
    blob = bytearray(encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE))
    blob[-1] ^= 0x01
    with pytest.raises(ChunkDecodeError, match="checksum"):
        decode_chunk(KEY, blob)


def test_an_unknown_format_version_is_a_decode_error() -> None:
    blob = bytearray(encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE))
    blob[4] = max(FORMAT_VERSIONS) + 1
    with pytest.raises(ChunkDecodeError, match="version"):
        decode_chunk(KEY, reseal(blob))


def test_an_unknown_codec_is_a_decode_error() -> None:
    blob = bytearray(encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE))
    blob[5] = 200
    with pytest.raises(ChunkDecodeError, match="codec"):
        decode_chunk(KEY, reseal(blob))


def test_an_unknown_dtype_is_a_decode_error() -> None:
    blob = bytearray(encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE))
    blob[33:41] = b"bfloat17"
    with pytest.raises(ChunkDecodeError, match="dtype"):
        decode_chunk(KEY, reseal(blob))


def test_a_shape_that_does_not_fit_the_payload_is_a_decode_error() -> None:
    blob = bytearray(encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE))
    struct.pack_into("<Q", blob, 42, 3)
    with pytest.raises(ChunkDecodeError, match="does not fit"):
        decode_chunk(KEY, reseal(blob))


def test_bytes_that_are_not_a_chunk_are_a_decode_error() -> None:
    with pytest.raises(ChunkDecodeError, match="magic"):
        decode_chunk(KEY, b"GET / HTTP/1.1\r\nHost: kvtier\r\n\r\n" + bytes(64))


def test_a_decode_error_is_a_connector_error() -> None:
    assert issubclass(ChunkDecodeError, ConnectorError)


def test_an_unknown_codec_name_is_rejected_when_encoding() -> None:
    with pytest.raises(ConfigError, match="codec must be one of raw, zstd"):
        encode_chunk(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE, codec="lz4")


def test_an_unknown_dtype_name_is_rejected_when_encoding() -> None:
    with pytest.raises(ConfigError, match="dtype must be one of"):
        encode_chunk(KEY, PAYLOAD, dtype="torch.bfloat16", shape=SHAPE)


def test_a_payload_that_does_not_fit_the_shape_is_rejected_when_encoding() -> None:
    with pytest.raises(ValueError, match="needs 48"):
        encode_chunk(KEY, PAYLOAD[:-2], dtype="bfloat16", shape=SHAPE)


def test_a_non_contiguous_payload_is_rejected_when_encoding() -> None:
    strided = memoryview(bytes(96))[::2]
    with pytest.raises(ValueError, match="contiguous"):
        encode_chunk(KEY, strided, dtype="bfloat16", shape=SHAPE)


# -- the zstd codec -------------------------------------------------------------

KV_LIKE = bytes(range(64)) * 64 + bytes(4096)  # compressible, 8 KiB
KV_SHAPE = (2, 2048)


def zstd_blob() -> bytearray:
    return bytearray(encode_chunk_bytes(KEY, KV_LIKE, dtype="bfloat16", shape=KV_SHAPE, codec="zstd"))


def test_a_zstd_chunk_decodes_to_the_raw_payload_and_is_smaller() -> None:
    blob = zstd_blob()
    chunk = decode_chunk(KEY, blob)
    assert (chunk.dtype, chunk.shape, chunk.codec) == ("bfloat16", KV_SHAPE, "zstd")
    assert chunk.payload == KV_LIKE
    assert len(blob) < len(KV_LIKE) // 4
    assert blob[5] == 1  # the codec id in the header


def test_every_flipped_bit_of_a_zstd_chunk_is_a_decode_error() -> None:
    blob = zstd_blob()
    for bit in range(0, len(blob) * 8, 3):
        corrupt = bytearray(blob)
        corrupt[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ChunkDecodeError):
            decode_chunk(KEY, corrupt)


def test_a_corrupt_zstd_payload_is_caught_by_the_checksum_before_decompressing() -> None:
    blob = zstd_blob()
    blob[-3] ^= 0x40
    with pytest.raises(ChunkDecodeError, match="checksum") as caught:
        decode_chunk(KEY, blob)
    assert caught.value.reason == "checksum"


def test_a_resealed_payload_that_is_not_zstd_is_a_codec_error() -> None:
    """Garbage that passes the checksum (a buggy writer) still never reaches the engine."""
    blob = zstd_blob()
    header_size = struct.unpack_from("<H", blob, 6)[0]
    blob[header_size : header_size + 4] = b"junk"  # no zstd magic any more
    with pytest.raises(ChunkDecodeError, match="zstd") as caught:
        decode_chunk(KEY, reseal(blob))
    assert caught.value.reason == "codec"


def test_a_zstd_frame_of_another_size_is_rejected_before_decompressing() -> None:
    import zstandard

    bigger = zstandard.ZstdCompressor().compress(bytes(1 << 20))
    blob = bytearray(encode_chunk_bytes(KEY, bytes(48), dtype="bfloat16", shape=SHAPE))
    header_size = struct.unpack_from("<H", blob, 6)[0]
    blob[5] = 1  # claim zstd, and carry a frame of 1 MiB for a 48-byte shape
    blob[24:32] = struct.pack("<Q", len(bigger))
    forged = reseal(blob[:header_size] + bytearray(bigger))
    with pytest.raises(ChunkDecodeError, match="holds 1048576 bytes") as caught:
        decode_chunk(KEY, forged)
    assert caught.value.reason == "layout"


def test_a_zstd_payload_must_fit_the_shape_when_encoding() -> None:
    with pytest.raises(ValueError, match="needs 48"):
        encode_chunk(KEY, PAYLOAD[:-2], dtype="bfloat16", shape=SHAPE, codec="zstd")


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (lambda b: b[:10], "truncated"),
        (lambda b: b"XXXX" + b[4:], "format"),
        (lambda b: b + b"\x00", "length"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum"),
    ],
    ids=["truncated", "format", "length", "checksum"],
)
def test_decode_errors_carry_a_reason_from_the_bounded_set(corrupt, reason: str) -> None:
    blob = encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE)
    with pytest.raises(ChunkDecodeError) as caught:
        decode_chunk(KEY, corrupt(blob))
    assert caught.value.reason == reason
    with pytest.raises(ChunkDecodeError) as other_key:
        decode_chunk(OTHER_KEY, blob)
    assert other_key.value.reason == "fingerprint"
    assert reason in CHUNK_ERROR_REASONS
