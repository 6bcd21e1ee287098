"""Encoder-output keys: every pinned field counts, the encoding is unambiguous, and an
encoder entry can never be taken for a KV chunk (or the other way round)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from kvtier.connector.chunks.codec import decode_chunk, encode_chunk_bytes
from kvtier.connector.chunks.encoder_keys import EncoderKeySpec, encoder_key, processor_fingerprint
from kvtier.connector.chunks.keys import KeySpec, chunk_keys
from kvtier.connector.errors import ChunkDecodeError, ConfigError

SPEC = EncoderKeySpec(model_id="org/model", model_revision="r1", processor="p")
ITEM = "a" * 64


def field(name: str, value: str) -> bytes:
    """The documented field encoding: u32 length + name, u32 length + UTF-8 value."""
    raw_name, raw_value = name.encode(), value.encode()
    return (
        len(raw_name).to_bytes(4, "little")
        + raw_name
        + len(raw_value).to_bytes(4, "little")
        + raw_value
    )


def test_the_key_is_sha256_of_the_documented_fields_starting_with_the_encoder_tag() -> None:
    fields = [
        ("kvtier", "encoder-output"),
        ("key_schema_version", "1"),
        ("model_id", "org/model"),
        ("model_revision", "r1"),
        ("encoder_dtype", "bfloat16"),
        ("processor", "p"),
        ("hash_algo", "sha256"),
        ("modality", "image"),
        ("cache_salt", ""),
        ("salt", ""),
        ("lora_name", ""),
        ("identifier", ITEM),
    ]
    preimage = b"".join(field(n, v) for n, v in fields)
    assert encoder_key(SPEC, ITEM, "image") == hashlib.sha256(preimage).digest()


def test_an_encoder_key_input_and_a_chunk_key_input_differ_in_their_first_field() -> None:
    """Both start with the length-prefixed ``kvtier`` field; its values differ, and a
    length-prefixed encoding is prefix-free, so no encoder input equals a chunk input."""
    encoder_tag, chunk_tag = field("kvtier", "encoder-output"), field("kvtier", "chunk-key")
    assert encoder_tag != chunk_tag
    assert not encoder_tag.startswith(chunk_tag) and not chunk_tag.startswith(encoder_tag)
    kv_spec = KeySpec(model_id="org/model", model_revision="r1", block_size=16, chunk_size=16)
    kv_keys = set(chunk_keys(list(range(64)), [], kv_spec))
    assert encoder_key(SPEC, ITEM, "image") not in kv_keys


def test_an_entry_stored_under_a_chunk_key_is_refused_under_an_encoder_key() -> None:
    kv_key = chunk_keys(list(range(16)), [], KeySpec(model_id="m", block_size=16, chunk_size=16))[0]
    blob = encode_chunk_bytes(kv_key, bytes(8), dtype="bfloat16", shape=(2, 2))
    with pytest.raises(ChunkDecodeError, match="another key"):
        decode_chunk(encoder_key(SPEC, ITEM, "image"), blob)


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "org/other"},
        {"model_revision": "r2"},
        {"encoder_dtype": "float16"},
        {"processor": "q"},
        {"hash_algo": "xxh3_128"},
    ],
)
def test_every_pinned_engine_field_changes_the_key(change: dict[str, str]) -> None:
    other = dataclasses.replace(SPEC, **change)
    assert encoder_key(other, ITEM, "image") != encoder_key(SPEC, ITEM, "image")


@pytest.mark.parametrize(
    "change",
    [
        {"identifier": "b" * 64},
        {"modality": "audio"},
        {"cache_salt": "tenant-a"},
        {"salt": "deployment"},
        {"lora_name": "adapter"},
    ],
)
def test_every_item_field_changes_the_key(change: dict[str, str]) -> None:
    args = {"identifier": ITEM, "modality": "image", **change}
    identifier, modality = args.pop("identifier"), args.pop("modality")
    assert encoder_key(SPEC, identifier, modality, **args) != encoder_key(SPEC, ITEM, "image")


def test_fields_cannot_trade_characters() -> None:
    assert encoder_key(SPEC, "ab", "image", cache_salt="c") != encoder_key(
        SPEC, "a", "image", cache_salt="bc"
    )


def test_empty_and_missing_optional_fields_are_the_same() -> None:
    assert encoder_key(SPEC, ITEM, "image", cache_salt="", salt=None) == encoder_key(
        SPEC, ITEM, "image"
    )


def test_a_user_supplied_uuid_works_as_identifier() -> None:
    assert len(encoder_key(SPEC, "my-image-0001", "image")) == 32


def test_xxh3_keys_have_16_bytes() -> None:
    spec = dataclasses.replace(SPEC, hash_algo="xxh3_128")
    assert len(encoder_key(spec, ITEM, "image")) == spec.key_size == 16


@pytest.mark.parametrize(
    ("change", "field_name"),
    [
        ({"model_id": ""}, "model_id"),
        ({"encoder_dtype": ""}, "encoder_dtype"),
        ({"hash_algo": "md5"}, "hash_algo"),
        ({"model_revision": None}, "model_revision"),
    ],
)
def test_a_bad_spec_names_the_field(change: dict[str, object], field_name: str) -> None:
    with pytest.raises(ConfigError, match=f"EncoderKeySpec.{field_name}"):
        dataclasses.replace(SPEC, **change)


@pytest.mark.parametrize(("identifier", "modality"), [("", "image"), (ITEM, "")])
def test_an_empty_identifier_or_modality_is_refused(identifier: str, modality: str) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        encoder_key(SPEC, identifier, modality)


def test_the_processor_fingerprint_follows_the_model_dirs_processor_files(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text('{"max_pixels": 50176}')
    before = processor_fingerprint(None, str(tmp_path))
    (tmp_path / "preprocessor_config.json").write_text('{"max_pixels": 100352}')
    assert processor_fingerprint(None, str(tmp_path)) != before


def test_the_processor_fingerprint_follows_mm_processor_kwargs_not_their_order() -> None:
    a = processor_fingerprint({"max_pixels": 1, "min_pixels": 2}, None)
    assert a == processor_fingerprint({"min_pixels": 2, "max_pixels": 1}, None)
    assert a != processor_fingerprint({"min_pixels": 2, "max_pixels": 3}, None)
