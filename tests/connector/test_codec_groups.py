"""Chunk format version 2: the KV cache group a chunk belongs to, and its first block."""

from __future__ import annotations

import pytest

from kvtier.connector.chunks.codec import decode_chunk, encode_chunk, encode_chunk_bytes
from kvtier.connector.errors import ChunkDecodeError
from tests.connector.test_codec import KEY, PAYLOAD, PINNED_HEADER, SHAPE, reseal

GROUP = "1/2 sliding_window=512"

# Format version 2 of PAYLOAD under b"pinned-key" as bfloat16 (2, 3, 4), group GROUP,
# first block 1: changing it fails test_the_group_header_format_is_pinned.
PINNED_GROUP_HEADER = (
    "4b5654430200"  # magic, version 2, codec 0 (raw)
    "6500"  # header size 101
    "15c9d8d1fe920224cec6aafbcc49f7f1"  # key fingerprint
    "3000000000000000"  # payload size 48
    "0862666c6f61743136"  # dtype "bfloat16"
    "03"
    "0200000000000000"
    "0300000000000000"
    "0400000000000000"  # shape (2, 3, 4)
    "16312f3220736c6964696e675f77696e646f773d353132"  # group "1/2 sliding_window=512"
    "01000000"  # first block 1
    "157bb7182c54de4e"  # checksum
)


def test_the_group_header_format_is_pinned() -> None:
    header, _ = encode_chunk(
        b"pinned-key", PAYLOAD, dtype="bfloat16", shape=SHAPE, group=GROUP, first_block=1
    )
    assert bytes(header).hex() == PINNED_GROUP_HEADER


def test_a_chunk_without_a_group_is_written_as_format_version_1_byte_for_byte() -> None:
    header, _ = encode_chunk(b"pinned-key", PAYLOAD, dtype="bfloat16", shape=SHAPE, group="")
    assert bytes(header).hex() == PINNED_HEADER


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_group_and_first_block_round_trip(codec: str) -> None:
    blob = encode_chunk_bytes(
        KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE, codec=codec, group=GROUP, first_block=3
    )
    decoded = decode_chunk(KEY, blob)
    assert (decoded.group, decoded.first_block) == (GROUP, 3)
    assert bytes(decoded.payload) == PAYLOAD


def test_a_first_block_alone_makes_a_version_2_chunk() -> None:
    blob = encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE, first_block=2)
    assert blob[4] == 2
    assert (decode_chunk(KEY, blob).group, decode_chunk(KEY, blob).first_block) == ("", 2)


def test_a_version_1_chunk_reads_as_no_group_from_block_0() -> None:
    decoded = decode_chunk(KEY, encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE))
    assert (decoded.group, decoded.first_block) == ("", 0)


def test_a_version_2_header_without_its_group_fields_is_a_layout_error() -> None:
    blob = bytearray(encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE))
    blob[4] = 2  # claims version 2, has version 1's fields
    with pytest.raises(ChunkDecodeError, match="group fields") as caught:
        decode_chunk(KEY, reseal(blob))
    assert caught.value.reason == "layout"


def test_a_group_length_past_the_header_is_a_layout_error() -> None:
    blob = bytearray(
        encode_chunk_bytes(KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE, group=GROUP)
    )
    blob[blob.index(GROUP.encode()) - 1] = 200
    with pytest.raises(ChunkDecodeError) as caught:
        decode_chunk(KEY, reseal(blob))
    assert caught.value.reason == "layout"


@pytest.mark.parametrize(
    ("group", "first_block"),
    [("é", 0), ("x" * 256, 0), ("g", -1), ("g", 2**32), ("g", True)],
    ids=["not-ascii", "too-long", "negative", "too-big", "bool"],
)
def test_a_bad_group_or_first_block_is_refused_when_encoding(group: str, first_block: int) -> None:
    with pytest.raises(ValueError, match=r"group|first_block"):
        encode_chunk(
            KEY, PAYLOAD, dtype="bfloat16", shape=SHAPE, group=group, first_block=first_block
        )
