"""Stored chunks: a small self-describing header, then the payload (docs/keys.md).

Header, format version 1, little-endian::

    offset  size  field
    0       4     magic b"KVTC"
    4       1     format version (1 or 2)
    5       1     codec id (CODEC_IDS)
    6       2     header length in bytes, this table included
    8       16    key fingerprint (keys.key_fingerprint)
    24      8     payload length in bytes
    32      1+n   dtype: u8 length + ASCII name (DTYPE_SIZES)
    ..      1+8d  shape: u8 ndim + ndim x u64
    ..      8     checksum: xxh3_64 of the header bytes before it, then the payload

Format version 2 (a chunk of one KV cache group of an engine with several, or of a
group that keeps only some blocks: ``kvtier.connector.kv.groups``) adds, before the
checksum::

    ..      1+g   group: u8 length + ASCII tag (e.g. "1/6 sliding_window=1024")
    ..      4     first block: the first of the chunk's blocks the payload holds (u32)

A chunk with no group and first block 0 is written as version 1, byte for byte what
kvtier wrote before groups existed; ``DecodedChunk`` reads ``group=""``,
``first_block=0`` from it.

With the ``raw`` codec neither direction copies the payload: ``encode_chunk`` returns
the header and a view of the caller's buffer (send them as frames), ``decode_chunk``
returns a view into the blob. With ``zstd`` the stored payload is the zstd frame of
the raw bytes: the payload length and the checksum are the compressed bytes', the
dtype and shape the decoded tensor's, and decoding checks the decompressed length
against them. Every verification failure raises ``ChunkDecodeError``: a miss.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

import xxhash

from kvtier.connector.chunks.finite import first_nonfinite
from kvtier.connector.chunks.keys import FINGERPRINT_SIZE, key_fingerprint
from kvtier.connector.errors import ChunkDecodeError, ConfigError, NonFiniteChunk

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "CODEC_IDS",
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "FORMAT_VERSIONS",
    "MAGIC",
    "ZSTD_LEVEL",
    "DecodedChunk",
    "decode_chunk",
    "encode_chunk",
    "encode_chunk_bytes",
]

MAGIC: Final = b"KVTC"
FORMAT_VERSION: Final = 1
"""The version of a chunk without a group (``FORMAT_VERSIONS``: every version read)."""
FORMAT_VERSIONS: Final = (1, 2)

CODEC_IDS: Final[Mapping[str, int]] = MappingProxyType({"raw": 0, "zstd": 1})
"""Codec name -> id in the header. ``raw`` stores the bytes as given; ``zstd`` stores them
zstd-compressed (lossless; the ``zstandard`` package, ``kvtier[connector]``). Reserved for
later: 2 lz4 (1-15 lossless), 16-31 lossy (16 fp8_e4m3, 17 int8)."""

ZSTD_LEVEL: Final = 1
"""zstd compression level of the ``zstd`` codec (docs/connector.md: higher levels cost
far more time for little more ratio on KV bytes)."""

DTYPE_SIZES: Final[Mapping[str, int]] = MappingProxyType(
    {
        "bfloat16": 2,
        "float16": 2,
        "float32": 4,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "int8": 1,
        "uint8": 1,
    }
)
"""Accepted dtype names (torch's, without ``torch.``) and their item sizes in bytes."""

_FIXED: Final = struct.Struct(f"<4sBBH{FINGERPRINT_SIZE}sQ")
_CHECKSUM: Final = struct.Struct("<Q")
_DIM: Final = struct.Struct("<Q")
_FIRST_BLOCK: Final = struct.Struct("<I")
_MAX_NDIM: Final = 16
_CODEC_NAMES: Final = {codec_id: name for name, codec_id in CODEC_IDS.items()}


@dataclass(frozen=True)
class DecodedChunk:
    """A verified chunk. ``payload`` is a view into the decoded blob, not a copy."""

    dtype: str
    shape: tuple[int, ...]
    codec: str
    payload: memoryview
    group: str = ""
    """The KV cache group the chunk belongs to (``""``: an engine's only full-attention group)."""
    first_block: int = 0
    """The first of the chunk's blocks the payload holds."""


def encode_chunk(
    key: bytes,
    payload: Buffer,
    *,
    dtype: str,
    shape: tuple[int, ...],
    codec: str = "raw",
    group: str = "",
    first_block: int = 0,
    check_finite: bool | str = False,
) -> list[Buffer]:
    """The chunk as ``[header, payload view]``: write or send them in order, unjoined.

    ``payload`` must be C-contiguous; it is not copied, so it must not change until the
    frames are sent. ``group`` and ``first_block``: the KV cache group and the chunk's
    first block the payload holds (format version 2). Raises ``ConfigError`` for an
    unknown dtype or codec and ``ValueError`` when the payload does not have ``shape`` x
    ``dtype`` bytes, or for a group tag that is not ASCII of at most 255 bytes.

    With ``check_finite``, a floating-point payload holding a NaN or an infinity raises
    ``NonFiniteChunk`` (``chunks/finite.py``); a dtype name there scans the payload as that
    dtype instead (an fp8 KV cache's ``uint8`` bytes as ``float8_e4m3fn``).
    """
    if codec not in CODEC_IDS:
        raise ConfigError(f"codec must be one of {', '.join(CODEC_IDS)}, got {codec!r}")
    if dtype not in DTYPE_SIZES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_SIZES)}, got {dtype!r}")
    if len(shape) > _MAX_NDIM or any(
        isinstance(dim, bool) or not isinstance(dim, int) or dim < 0 for dim in shape
    ):
        raise ValueError(f"shape must be at most {_MAX_NDIM} ints >= 0, got {shape!r}")
    view = memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("payload must be a C-contiguous buffer")
    data: Buffer = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if memoryview(data).nbytes != expected:
        raise ValueError(
            f"payload has {memoryview(data).nbytes} bytes, but shape {shape} of {dtype} "
            f"needs {expected}"
        )
    group_field = _group_field(group, first_block)
    scan = check_finite if isinstance(check_finite, str) else dtype if check_finite else ""
    if scan and (found := first_nonfinite(data, scan)) >= 0:  # raw bytes, not compressed
        raise NonFiniteChunk(f"the chunk's payload holds a NaN or an infinity ({scan} element {found})", found)
    if codec == "zstd":
        data = _zstd().ZstdCompressor(level=ZSTD_LEVEL).compress(data)
    name = dtype.encode("ascii")
    head = b"".join(
        (
            _FIXED.pack(
                MAGIC,
                2 if group_field else FORMAT_VERSION,
                CODEC_IDS[codec],
                _FIXED.size
                + 1
                + len(name)
                + 1
                + _DIM.size * len(shape)
                + len(group_field)
                + _CHECKSUM.size,
                key_fingerprint(key),
                memoryview(data).nbytes,
            ),
            bytes((len(name),)),
            name,
            bytes((len(shape),)),
            *(_DIM.pack(dim) for dim in shape),
            group_field,
        )
    )
    checksum = xxhash.xxh3_64(head)
    checksum.update(data)
    return [head + _CHECKSUM.pack(checksum.intdigest()), data]


def encode_chunk_bytes(
    key: bytes,
    payload: Buffer,
    *,
    dtype: str,
    shape: tuple[int, ...],
    codec: str = "raw",
    group: str = "",
    first_block: int = 0,
) -> bytes:
    """The chunk as one ``bytes`` (one copy of the payload); see ``encode_chunk``."""
    return b"".join(
        encode_chunk(
            key,
            payload,
            dtype=dtype,
            shape=shape,
            codec=codec,
            group=group,
            first_block=first_block,
        )
    )


def _group_field(group: str, first_block: int) -> bytes:
    """The group and first-block fields of format version 2 (``b""``: version 1)."""
    if isinstance(first_block, bool) or not isinstance(first_block, int):
        raise ValueError(f"first_block must be an int, got {first_block!r}")
    if not 0 <= first_block < 2**32:
        raise ValueError(f"first_block must be in [0, 2**32), got {first_block}")
    if not isinstance(group, str) or not group.isascii() or len(group) > 255:
        raise ValueError(f"group must be an ASCII str of at most 255 bytes, got {group!r}")
    if not group and not first_block:
        return b""
    return bytes((len(group),)) + group.encode("ascii") + _FIRST_BLOCK.pack(first_block)


def decode_chunk(key: bytes, blob: Buffer) -> DecodedChunk:
    """Verify ``blob`` as the chunk stored under ``key`` and return its parts.

    Raises ``ChunkDecodeError`` if the blob is truncated or too long, is not a kvtier
    chunk, has an unknown format version or codec, belongs to another key, or fails
    its checksum.
    """
    view = memoryview(blob)
    data = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if data.nbytes < _FIXED.size:
        raise ChunkDecodeError(
            f"chunk truncated: {data.nbytes} bytes, header needs more", "truncated"
        )
    magic, version, codec_id, header_size, fingerprint, payload_size = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise ChunkDecodeError("not a kvtier chunk (bad magic)", "format")
    if version not in FORMAT_VERSIONS:
        raise ChunkDecodeError(f"unknown chunk format version {version}", "format")
    if codec_id not in _CODEC_NAMES:
        raise ChunkDecodeError(f"unknown chunk codec id {codec_id}", "codec")
    if fingerprint != key_fingerprint(key):
        raise ChunkDecodeError(
            "chunk belongs to another key (fingerprint mismatch)", "fingerprint"
        )
    if header_size < _FIXED.size + 3 + _CHECKSUM.size or header_size + payload_size != data.nbytes:
        raise ChunkDecodeError(
            f"chunk length mismatch: {data.nbytes} bytes, header says "
            f"{header_size} + {payload_size}",
            "length",
        )
    body = header_size - _CHECKSUM.size
    checksum = xxhash.xxh3_64(data[:body])
    checksum.update(data[header_size:])
    if checksum.intdigest() != _CHECKSUM.unpack_from(data, body)[0]:
        raise ChunkDecodeError("chunk checksum mismatch", "checksum")
    dtype, shape, group, first_block = _parse_layout(data[_FIXED.size : body], version)
    codec = _CODEC_NAMES[codec_id]
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    payload = data[header_size:]
    if codec == "zstd":
        payload = _unzstd(payload, expected)
    if payload.nbytes != expected:
        raise ChunkDecodeError(
            f"{codec} payload of {payload.nbytes} bytes does not fit {shape} {dtype}", "layout"
        )
    return DecodedChunk(dtype, shape, codec, payload, group, first_block)


def _zstd() -> Any:
    """The ``zstandard`` module (imported on first use: only the zstd codec needs it)."""
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - a venv without the connector extra
        raise ConfigError(
            "codec 'zstd' needs the zstandard package: pip install 'kvtier[connector]'"
        ) from exc
    return zstandard


def _unzstd(payload: memoryview, expected: int) -> memoryview:
    """The decompressed payload; at most ``expected`` bytes are ever allocated."""
    try:
        zstandard = _zstd()
        size = zstandard.frame_content_size(payload)
        if size != expected:  # checked before allocating: a forged size costs nothing
            raise ChunkDecodeError(
                f"zstd frame holds {size} bytes, the chunk's shape needs {expected}", "layout"
            )
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=expected)
    except ChunkDecodeError:
        raise
    except ConfigError as exc:
        raise ChunkDecodeError(f"cannot decode a zstd chunk here: {exc}", "codec") from exc
    except Exception as exc:  # zstandard.ZstdError, or a frame without a content size
        raise ChunkDecodeError(f"zstd payload does not decode: {exc}", "codec") from exc
    return memoryview(raw)


def _parse_layout(layout: memoryview, version: int) -> tuple[str, tuple[int, ...], str, int]:
    """The dtype, shape, group and first-block fields of a checksummed header."""
    size = layout[0]
    ndim_at = 1 + size
    if ndim_at >= len(layout):
        raise ChunkDecodeError("chunk header layout fields are malformed", "layout")
    group_at = ndim_at + 1 + _DIM.size * layout[ndim_at]
    group, first_block = "", 0
    if version == 2:
        end = group_at + 1 + (layout[group_at] if group_at < len(layout) else 0)
        if len(layout) != end + _FIRST_BLOCK.size:
            raise ChunkDecodeError("chunk header group fields are malformed", "layout")
        group = bytes(layout[group_at + 1 : end]).decode("ascii", "replace")
        (first_block,) = _FIRST_BLOCK.unpack_from(layout, end)
    elif len(layout) != group_at:
        raise ChunkDecodeError("chunk header layout fields are malformed", "layout")
    dtype = bytes(layout[1:ndim_at]).decode("ascii", "replace")
    if dtype not in DTYPE_SIZES:
        raise ChunkDecodeError(f"unknown chunk dtype {dtype!r}", "layout")
    shape = tuple(dim for (dim,) in _DIM.iter_unpack(layout[ndim_at + 1 : group_at]))
    return dtype, shape, group, first_block
