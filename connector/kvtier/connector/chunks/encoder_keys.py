"""Cache keys of encoder outputs (one key per multimodal item; docs/encoder-cache.md).

An encoder output (the embeddings a vision or audio encoder computes for one image,
clip or video) is stored under one hash over::

    kvtier tag           "encoder-output"  (KV chunk keys hash "chunk-key": never the same input)
    schema version       ENCODER_KEY_SCHEMA_VERSION
    pinned fields        model id and revision, encoder dtype, processor fingerprint, hash
                         algorithm                                 (per engine: EncoderKeySpec)
    item fields          modality, cache salt, deployment salt, LoRA adapter, identifier

Every field is ``u32 len + name, u32 len + UTF-8 value`` (``kvtier.connector.chunks.keys``'s
encoding), so no two different field tuples hash the same bytes, and the identifier
is hashed whole (vLLM's 64-hex ``mm_hash`` or a user-supplied uuid). The tenant is
not here: the tier places every key in the namespace of the caller's token.

This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvtier.connector.chunks.keys import HASH_ALGOS, _field, _new_hasher
from kvtier.connector.errors import ConfigError

__all__ = [
    "ENCODER_KEY_SCHEMA_VERSION",
    "PROCESSOR_FILES",
    "EncoderKeySpec",
    "encoder_key",
    "processor_fingerprint",
]

ENCODER_KEY_SCHEMA_VERSION: Final = 1
"""Bump on any change to what is hashed or how."""

KEY_TAG: Final = "encoder-output"
"""The ``kvtier`` field of every encoder key; chunk keys carry ``chunk-key``."""

PROCESSOR_FILES: Final = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
"""Files of a local model directory whose settings (resize bounds, patch size, mean and
std, sampling rate) change what the encoder sees; their bytes go into the fingerprint."""


@dataclass(frozen=True)
class EncoderKeySpec:
    """What makes an encoder output meaningful on one engine; pinned in every key.

    Raises ``ConfigError`` naming the field when a value is invalid.
    """

    model_id: str
    model_revision: str = ""
    encoder_dtype: str = "bfloat16"
    """The engine's model dtype (the encoder runs in it)."""
    processor: str = ""
    """``processor_fingerprint(...)``: processor settings that change the encoder output."""
    hash_algo: str = "sha256"
    """One of ``kvtier.connector.chunks.keys.HASH_ALGOS``."""

    def __post_init__(self) -> None:
        for name in ("model_id", "encoder_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"EncoderKeySpec.{name} must be a non-empty str, got {value!r}")
        for name in ("model_revision", "processor"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"EncoderKeySpec.{name} must be a str, got {value!r}")
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"EncoderKeySpec.hash_algo must be one of {', '.join(HASH_ALGOS)}, "
                f"got {self.hash_algo!r}"
            )

    @property
    def key_size(self) -> int:
        """Bytes in every key: 32 for sha256, 16 for xxh3_128."""
        return 16 if self.hash_algo == "xxh3_128" else 32


def encoder_key(
    spec: EncoderKeySpec,
    identifier: str,
    modality: str,
    *,
    cache_salt: str | None = None,
    salt: str | None = None,
    lora_name: str | None = None,
) -> bytes:
    """The key of one item's encoder output. ``None`` and ``""`` mean the same for the
    optional fields. Raises ``ValueError`` for an empty identifier or modality."""
    if not isinstance(identifier, str) or not identifier:
        raise ValueError(f"identifier must be a non-empty str, got {identifier!r}")
    if not isinstance(modality, str) or not modality:
        raise ValueError(f"modality must be a non-empty str, got {modality!r}")
    hasher = _new_hasher(spec.hash_algo)
    hasher.update(
        b"".join(
            _field(name, value)
            for name, value in (
                ("kvtier", KEY_TAG),
                ("key_schema_version", str(ENCODER_KEY_SCHEMA_VERSION)),
                ("model_id", spec.model_id),
                ("model_revision", spec.model_revision),
                ("encoder_dtype", spec.encoder_dtype),
                ("processor", spec.processor),
                ("hash_algo", spec.hash_algo),
                ("modality", modality),
                ("cache_salt", cache_salt or ""),
                ("salt", salt or ""),
                ("lora_name", lora_name or ""),
                ("identifier", identifier),
            )
        )
    )
    return hasher.digest()


def processor_fingerprint(
    processor_kwargs: Mapping[str, Any] | None, model_dir: str | None = None
) -> str:
    """A hex digest of the processor settings that change an encoder output: the engine's
    ``mm_processor_kwargs`` (canonical JSON) and, for a local model directory, the bytes
    of its ``PROCESSOR_FILES``. A hub model id is pinned by its revision instead."""
    parts: list[tuple[str, str]] = [
        (
            "mm_processor_kwargs",
            json.dumps(dict(processor_kwargs or {}), sort_keys=True, default=str),
        )
    ]
    if model_dir and os.path.isdir(model_dir):
        parts += [(name, _file_digest(os.path.join(model_dir, name))) for name in PROCESSOR_FILES]
    return _digest(parts)


def _file_digest(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return ""


def _digest(parts: Iterable[tuple[str, str]]) -> str:
    return hashlib.sha256(b"".join(_field(name, value) for name, value in parts)).hexdigest()
