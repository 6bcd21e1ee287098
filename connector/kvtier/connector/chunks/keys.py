"""Cache keys of prompt chunks, multimodal-aware (the scheme is in docs/keys.md).

A prompt is cut into chunks of ``KeySpec.chunk_size`` tokens; only *full*
chunks get a key (the partial tail is neither looked up nor stored). Chunk
``i``'s key is one hash over::

    pinned fields      kvtier tag, KEY_SCHEMA_VERSION, model id and revision, KV dtype,
                       KV layout, block and chunk size, TP and PP rank and world size,
                       hash algorithm, engine salt                (per engine: KeySpec)
    request fields     cache salt, LoRA adapter name and path      (per request)
    u8 len + parent    key of chunk i-1 (empty for chunk 0)
    u16 n + items      each multimodal item overlapping the chunk: its 32-byte digest and
                       its start relative to the chunk (i64)
    tokens             the chunk's token ids as little-endian u32, every placeholder
                       position overwritten with a value derived from the item's identifier

Text fields are length-prefixed (``u32 len + name``, ``u32 len + UTF-8 value``), so
no two different field tuples hash the same bytes. A multimodal item's material is
SHAKE-256 of its full identifier: the first 32 bytes are the item digest, the next
``4 * length`` bytes fill its placeholder span (high bit set, so no vocabulary id can
take a placeholder's value). Nothing here depends on ``hash()``, the process or the
machine's byte order.

The two hot loops, packing token ids and hashing the chunks, run in a small optional C
helper (``_keyhash``, connector/_keyhash.c) where pip could build it; the pure-Python
code here computes the same bytes without it (the tests run both).

This module imports neither vLLM nor torch: routers and tools can compute keys too.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from typing import TYPE_CHECKING, Final, Protocol

import xxhash

from kvtier.connector.errors import ConfigError

if TYPE_CHECKING:
    from types import ModuleType

    from typing_extensions import Buffer

_keyhash: ModuleType | None
try:  # the C helper (connector/_keyhash.c), built by pip when a compiler is at hand
    from kvtier.connector.chunks import _keyhash
except ImportError:  # pragma: no cover - depends on the build
    _keyhash = None

__all__ = [
    "FINGERPRINT_SIZE",
    "HASH_ALGOS",
    "KEY_SCHEMA_VERSION",
    "KeyChain",
    "KeySpec",
    "MMItem",
    "chunk_keys",
    "key_fingerprint",
    "pack_token_ids",
]

KEY_SCHEMA_VERSION: Final = 2
"""Bump on any change to what is hashed or how; tests/connector/key_vectors.json pins it."""

HASH_ALGOS: Final = ("sha256", "xxh3_128")
"""Accepted ``KeySpec.hash_algo`` values. ``sha256`` (the default) is collision resistant.
``xxh3_128`` is about 2x faster end to end but NOT collision resistant: anyone who
can send prompts can craft two prompts with one key and poison the cache. Use it only
when every client sharing a cache salt is trusted."""

FINGERPRINT_SIZE: Final = 16
"""Bytes of ``key_fingerprint``."""

_MAX_KEY_SIZE: Final = 64
_U32: Final = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN: Final = sys.byteorder == "big"
_NO_ITEMS: Final = b"\x00\x00"
_ITEM_DIGEST_SIZE: Final = 32
_HIGH_BIT: Final = bytes(b | 0x80 for b in range(256))


class _Hasher(Protocol):
    @property
    def digest_size(self) -> int: ...
    def copy(self) -> _Hasher: ...
    def update(self, data: Buffer, /) -> None: ...
    def digest(self) -> bytes: ...


def _new_hasher(algo: str) -> _Hasher:
    if algo == "xxh3_128":
        hasher: _Hasher = xxhash.xxh3_128()
        return hasher
    return hashlib.sha256()


def _field(name: str, value: str) -> bytes:
    """``name`` and ``value`` as ``u32 length + bytes`` each: an unambiguous encoding."""
    raw_name = name.encode()
    raw_value = value.encode("utf-8", "surrogatepass")
    return (
        len(raw_name).to_bytes(4, "little")
        + raw_name
        + len(raw_value).to_bytes(4, "little")
        + raw_value
    )


@dataclass(frozen=True)
class MMItem:
    """One multimodal item of a request (vLLM: an entry of ``request.mm_features``)."""

    identifier: str
    """Opaque and complete: vLLM's 64-hex ``identifier``/``mm_hash``, or a user-supplied uuid."""
    offset: int
    """Token index where the item's placeholder span starts."""
    length: int
    """Tokens in the placeholder span."""

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not self.identifier:
            raise ValueError(f"MMItem.identifier must be a non-empty str, got {self.identifier!r}")
        if _not_int(self.offset) or self.offset < 0:
            raise ValueError(f"MMItem.offset must be an int >= 0, got {self.offset!r}")
        if _not_int(self.length) or self.length < 1:
            raise ValueError(f"MMItem.length must be an int >= 1, got {self.length!r}")

    @property
    def end(self) -> int:
        """Token index just past the placeholder span."""
        return self.offset + self.length


@dataclass(frozen=True)
class KeySpec:
    """What makes a KV blob meaningful on one engine worker; every field is pinned in every key.

    Raises ``ConfigError`` naming the field when a value is invalid.
    """

    model_id: str
    model_revision: str = ""
    kv_dtype: str = "bfloat16"
    kv_layout: str = ""
    """Opaque engine layout string, e.g. ``"cpu:[blocks,kv_heads,block,2*head]"``."""
    block_size: int = 16
    """The engine's KV block size in tokens."""
    chunk_size: int = 256
    """Tokens per chunk (one key, one stored blob); a multiple of ``block_size``."""
    tp_rank: int = 0
    tp_world_size: int = 1
    hash_algo: str = "sha256"
    """One of ``HASH_ALGOS``."""
    pp_rank: int = 0
    """Pipeline-parallel stage: each stage holds the KV of different layers."""
    pp_world_size: int = 1
    salt: str = ""
    """A fixed salt of the engine (kv_connector_extra_config ``salt``, e.g. the namespace),
    hashed into every key next to each request's own ``cache_salt``; ``""``: none."""

    def __post_init__(self) -> None:
        for name in ("model_id", "kv_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"KeySpec.{name} must be a non-empty str, got {value!r}")
        for name in ("model_revision", "kv_layout", "salt"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"KeySpec.{name} must be a str, got {value!r}")
        for name in ("block_size", "chunk_size", "tp_world_size", "pp_world_size"):
            value = getattr(self, name)
            if _not_int(value) or value < 1:
                raise ConfigError(f"KeySpec.{name} must be an int >= 1, got {value!r}")
        if self.chunk_size % self.block_size:
            lower = max(self.block_size, self.chunk_size // self.block_size * self.block_size)
            raise ConfigError(
                f"KeySpec.chunk_size={self.chunk_size} must be a multiple of the engine's "
                f"block_size={self.block_size}; use e.g. {lower} or {lower + self.block_size}"
            )
        for rank, world in (("tp_rank", "tp_world_size"), ("pp_rank", "pp_world_size")):
            value, size = getattr(self, rank), getattr(self, world)
            if _not_int(value) or not 0 <= value < size:
                raise ConfigError(
                    f"KeySpec.{rank} must be an int in [0, {world}={size}), got {value!r}"
                )
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"KeySpec.hash_algo must be one of {', '.join(HASH_ALGOS)}, got {self.hash_algo!r}"
            )

    @property
    def key_size(self) -> int:
        """Bytes in every key: 32 for sha256, 16 for xxh3_128."""
        return 16 if self.hash_algo == "xxh3_128" else 32


class KeyChain:
    """The keys of one request's chunks, computed once and extended as tokens arrive.

    Keep one per request (e.g. in the scheduler's request state): ``extend`` with the
    prompt, later with new tokens, and only the newly completed chunks are hashed.
    Tokens that do not fill a chunk wait in the chain until they do.
    """

    __slots__ = ("_algo", "_base", "_chunk_size", "_items", "_keys", "_parent", "_prefix", "_tail")

    def __init__(
        self,
        spec: KeySpec,
        mm_items: Sequence[MMItem] = (),
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
    ) -> None:
        """``None`` and ``""`` mean the same for the request fields: no salt, no adapter."""
        items = tuple(sorted(mm_items, key=lambda item: item.offset))
        for before, after in pairwise(items):
            if after.offset < before.end:
                raise ValueError(
                    f"multimodal items overlap: tokens [{before.offset}, {before.end}) "
                    f"and [{after.offset}, {after.end})"
                )
        request = (
            _field("cache_salt", cache_salt or "")
            + _field("lora_name", lora_name or "")
            + _field("lora_path", lora_path or "")
        )
        self._algo = spec.hash_algo
        self._prefix = _pinned_fields(spec) + request
        self._base: _Hasher | None = None
        if _keyhash is None:
            self._base = _pinned_hasher(spec).copy()
            self._base.update(request)
        self._chunk_size = spec.chunk_size
        self._items = items
        self._keys: list[bytes] = []
        self._parent = b""
        self._tail = bytearray()
        """Tokens not yet in a full chunk, as native u32."""

    @property
    def keys(self) -> tuple[bytes, ...]:
        """Keys of every full chunk so far, in prompt order."""
        return tuple(self._keys)

    @property
    def num_tokens(self) -> int:
        """Tokens given to ``extend`` so far (including the partial tail)."""
        return len(self._keys) * self._chunk_size + len(self._tail) // 4

    def extend(self, token_ids: Sequence[int]) -> list[bytes]:
        """Append ``token_ids``; return the keys of the chunks this completed.

        ``token_ids`` may be any sequence of ints; an array from ``pack_token_ids`` is
        the fastest (no conversion). Raises ``ValueError`` (and appends nothing) if a
        token id is not in ``[0, 2**32)``.
        """
        if self._tail:
            self._tail += _packed(token_ids)
        else:
            self._tail = _packed(token_ids)  # the usual case: no copy
        buf = self._tail
        size = self._chunk_size
        first = len(self._keys)
        count = len(buf) // (4 * size)
        if not count:
            return []
        extras = self._apply_items(buf, first, count) if self._items else {}
        new_keys = self._hash_chunks(buf, first, count, extras)
        del buf[: count * size * 4]
        self._keys += new_keys
        return new_keys

    def _apply_items(self, buf: bytearray, first: int, count: int) -> dict[int, bytes]:
        """Overwrite placeholder spans in ``buf`` (which starts at chunk ``first``).

        Returns the items field of each of the ``count`` chunks about to be hashed that
        overlaps an item.
        """
        size = self._chunk_size
        start = first * size
        stop = start + len(buf) // 4
        hashed_stop = start + count * size
        entries: dict[int, list[bytes]] = {}
        for item in self._items:
            if item.end <= start:
                continue
            if item.offset >= stop:
                break
            lo, hi = max(item.offset, start), min(item.end, stop)
            digest, fill = _item_material(item.identifier, item.length)
            buf[(lo - start) * 4 : (hi - start) * 4] = fill[lo - item.offset : hi - item.offset]
            for chunk in range(lo // size, (min(hi, hashed_stop) - 1) // size + 1):
                relative = (item.offset - chunk * size).to_bytes(8, "little", signed=True)
                entries.setdefault(chunk, []).append(digest + relative)
        return {
            chunk: len(found).to_bytes(2, "little") + b"".join(found)
            for chunk, found in entries.items()
        }

    def _hash_chunks(
        self, buf: bytearray, first: int, count: int, extras: dict[int, bytes]
    ) -> list[bytes]:
        step = self._chunk_size * 4
        data: Buffer = buf
        if _BIG_ENDIAN:
            swapped = array(_U32, buf[: count * step])
            swapped.byteswap()
            data = swapped
        if _keyhash is not None:  # the same bytes, hashed in one C loop
            with memoryview(data) as view, view.cast("B") as raw, raw[: count * step] as whole:
                keys: list[bytes] = _keyhash.chain(
                    self._algo, self._prefix, self._parent, whole, step, first, extras
                )
            self._parent = keys[-1]
            return keys
        assert self._base is not None
        copy, get = self._base.copy, extras.get
        parent = self._parent
        tag = bytes((len(parent),))  # the parent field: u8 length + the parent key
        key_tag = bytes((self._base.digest_size,))
        keys = []
        with memoryview(data) as view, view.cast("B") as raw:
            for index, pos in enumerate(range(0, count * step, step), first):
                hasher = copy()
                hasher.update(tag + parent + get(index, _NO_ITEMS))
                hasher.update(raw[pos : pos + step])
                parent = hasher.digest()
                keys.append(parent)
                tag = key_tag
        self._parent = parent
        return keys


def chunk_keys(
    token_ids: Sequence[int],
    mm_items: Sequence[MMItem],
    spec: KeySpec,
    cache_salt: str | None = None,
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
) -> list[bytes]:
    """Keys of the FULL chunks of ``token_ids`` (a prompt or a prefix of one), in order.

    The partial last chunk gets no key: it is neither looked up nor stored, so a prompt
    of ``n`` tokens has ``n // spec.chunk_size`` keys. Spans of ``mm_items`` that run
    past the end of ``token_ids`` are cut. To reuse work as a request grows, keep a
    ``KeyChain`` instead.
    """
    chain = KeyChain(
        spec, mm_items, cache_salt=cache_salt, lora_name=lora_name, lora_path=lora_path
    )
    return chain.extend(token_ids)


def pack_token_ids(token_ids: Sequence[int]) -> array[int]:
    """``token_ids`` packed as u32: pack a prompt once to extend several chains with it
    (e.g. one per tensor-parallel rank) without converting the list again.

    Raises ``ValueError`` if a token id is not in ``[0, 2**32)``.
    """
    packed: array[int] = array(_U32)
    packed.frombytes(_packed(token_ids))
    return packed


def key_fingerprint(key: bytes) -> bytes:
    """A 16-byte fingerprint of ``key`` (xxh3_128), stored in chunk headers."""
    if not 0 < len(key) <= _MAX_KEY_SIZE:
        raise ValueError(f"a key has 1 to {_MAX_KEY_SIZE} bytes, got {len(key)}")
    return xxhash.xxh3_128_digest(key)


@lru_cache(maxsize=64)
def _pinned_hasher(spec: KeySpec) -> _Hasher:
    """A hasher already fed the pinned fields of ``spec``; every key starts from a copy."""
    hasher = _new_hasher(spec.hash_algo)
    hasher.update(_pinned_fields(spec))
    return hasher


@lru_cache(maxsize=64)
def _pinned_fields(spec: KeySpec) -> bytes:
    """The pinned fields of ``spec``, encoded: the start of every key's hashed bytes."""
    return b"".join(
        _field(name, str(value))
        for name, value in (
            ("kvtier", "chunk-key"),
            ("key_schema_version", KEY_SCHEMA_VERSION),
            ("model_id", spec.model_id),
            ("model_revision", spec.model_revision),
            ("kv_dtype", spec.kv_dtype),
            ("kv_layout", spec.kv_layout),
            ("block_size", spec.block_size),
            ("chunk_size", spec.chunk_size),
            ("tp_rank", spec.tp_rank),
            ("tp_world_size", spec.tp_world_size),
            ("pp_rank", spec.pp_rank),
            ("pp_world_size", spec.pp_world_size),
            ("hash_algo", spec.hash_algo),
            ("salt", spec.salt),
        )
    )


@lru_cache(maxsize=512)
def _item_material(identifier: str, length: int) -> tuple[bytes, array[int]]:
    """The item's 32-byte digest and its ``length`` placeholder values (native u32).

    SHAKE-256 is an extendable-output function: longer outputs start with the shorter
    ones, so a value depends only on the identifier and its position in the span.
    """
    stream = hashlib.shake_256(_field("kvtier", "mm-item") + _field("identifier", identifier))
    material = stream.digest(_ITEM_DIGEST_SIZE + 4 * length)
    values = bytearray(material[_ITEM_DIGEST_SIZE:])
    values[3::4] = values[3::4].translate(_HIGH_BIT)  # top byte of each little-endian u32
    fill = array(_U32, values)
    if _BIG_ENDIAN:
        fill.byteswap()
    return material[:_ITEM_DIGEST_SIZE], fill


def _packed(token_ids: Sequence[int]) -> bytearray:
    """``token_ids`` as native u32 bytes; ``ValueError`` if one is not in ``[0, 2**32)``."""
    if isinstance(token_ids, array) and token_ids.typecode == _U32:
        return bytearray(token_ids)  # a memcpy
    try:
        if _keyhash is not None:
            packed: bytearray = _keyhash.pack_u32(token_ids)  # ~3x faster than fromlist
            return packed
        # array.fromlist: the fastest conversion of ints the standard library has
        return bytearray(array(_U32, token_ids if isinstance(token_ids, list) else list(token_ids)))
    except (OverflowError, TypeError) as exc:
        raise ValueError("token_ids must be ints in [0, 2**32)") from exc


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)
