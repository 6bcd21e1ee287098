"""Chunk keys: multimodal substitution, pinned fields, prefix chaining, determinism.

``key_vectors.json`` pins the scheme. After an intended change to it, bump
``KEY_SCHEMA_VERSION`` and rewrite the vectors with
``.venv/bin/python -m tests.connector.test_keys --write-vectors``.

Every test runs twice: with the C helper (``kvtier.connector.chunks._keyhash``) and with the
pure-Python code that replaces it where it is not built.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pickle
import struct
import subprocess
import sys
from array import array
from collections.abc import Iterator
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.connector.chunks import keys as keys_module
from kvtier.connector.chunks.keys import (
    HASH_ALGOS,
    KEY_SCHEMA_VERSION,
    KeyChain,
    KeySpec,
    MMItem,
    chunk_keys,
    key_fingerprint,
    pack_token_ids,
)
from kvtier.connector.errors import ConfigError

VECTORS = Path(__file__).with_name("key_vectors.json")
UNTIMED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""Hypothesis without its clocks: on a shared, loaded machine a slow example is load, not a bug."""
PLACEHOLDER = 151655  # Qwen2-VL's <|image_pad|>: the same id for every image
IMAGE_A = "a3" * 32
IMAGE_B = "b7" * 32


@pytest.fixture(scope="module", autouse=True, params=["c", "python"])
def implementation(request: pytest.FixtureRequest) -> Iterator[str]:
    """The module's tests with the C helper, then with the pure-Python code."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "python":
            patch.setattr(keys_module, "_keyhash", None)
        yield request.param


token_lists = st.lists(st.integers(0, 2**17), max_size=120)
identifiers = st.one_of(
    st.binary(min_size=32, max_size=32).map(bytes.hex), st.uuids().map(str), st.text(min_size=1)
)


@st.composite
def small_specs(draw: st.DrawFn) -> KeySpec:
    block = draw(st.sampled_from([1, 2, 4]))
    chunk = block * draw(st.integers(1, 4))
    return KeySpec("tiny", block_size=block, chunk_size=chunk, salt=draw(st.text(max_size=3)))


@st.composite
def prompts(draw: st.DrawFn) -> tuple[list[int], list[MMItem]]:
    """Token ids with zero to three images laid out one after another."""
    tokens = draw(token_lists)
    items: list[MMItem] = []
    position = 0
    for _ in range(draw(st.integers(0, 3))):
        offset = position + draw(st.integers(0, 20))
        length = draw(st.integers(1, 30))
        items.append(MMItem(draw(identifiers), offset, length))
        position = offset + length
    padding = max(0, position - len(tokens)) + draw(st.integers(0, 20))
    tokens += [PLACEHOLDER] * padding
    for item in items:
        tokens[item.offset : item.end] = [PLACEHOLDER] * item.length
    return tokens, items


def text_with_image(before: int, length: int, after: int) -> list[int]:
    return list(range(1, before + 1)) + [PLACEHOLDER] * length + list(range(after))


@UNTIMED
@given(
    small_specs(),
    st.integers(0, 40),
    st.integers(1, 40),
    st.integers(0, 40),
    st.tuples(identifiers, identifiers).filter(lambda pair: pair[0] != pair[1]),
)
def test_same_text_with_a_different_image_shares_keys_only_before_the_image_chunk(
    spec: KeySpec, before: int, length: int, after: int, images: tuple[str, str]
) -> None:
    tokens = text_with_image(before, length, after)
    keys_a = chunk_keys(tokens, [MMItem(images[0], before, length)], spec)
    keys_b = chunk_keys(tokens, [MMItem(images[1], before, length)], spec)
    first = before // spec.chunk_size
    assert keys_a[:first] == keys_b[:first]
    assert all(a != b for a, b in zip(keys_a[first:], keys_b[first:], strict=True))


@UNTIMED
@given(small_specs(), prompts(), st.text(max_size=8))
def test_the_same_image_and_text_give_the_same_keys(
    spec: KeySpec, prompt: tuple[list[int], list[MMItem]], salt: str
) -> None:
    tokens, items = prompt
    copies = [MMItem(str(item.identifier), item.offset, item.length) for item in items]
    assert chunk_keys(tokens, items, spec, salt) == chunk_keys(
        list(tokens), list(reversed(copies)), replace(spec), salt
    )


@UNTIMED
@given(small_specs(), prompts())
def test_placeholder_token_ids_do_not_change_keys(
    spec: KeySpec, prompt: tuple[list[int], list[MMItem]]
) -> None:
    tokens, items = prompt
    other = list(tokens)
    for item in items:
        other[item.offset : item.end] = range(item.length)
    assert chunk_keys(tokens, items, spec) == chunk_keys(other, items, spec)


def test_an_image_at_another_position_changes_keys_from_its_chunk_on() -> None:
    spec = KeySpec("tiny", block_size=4, chunk_size=8)
    tokens = [7] * 40
    keys_at_10 = chunk_keys(tokens, [MMItem(IMAGE_A, 10, 12)], spec)
    keys_at_11 = chunk_keys(tokens, [MMItem(IMAGE_A, 11, 12)], spec)
    assert keys_at_10[0] == keys_at_11[0]
    assert all(a != b for a, b in zip(keys_at_10[1:], keys_at_11[1:], strict=True))


@settings(UNTIMED, max_examples=300)
@given(st.tuples(identifiers, identifiers).filter(lambda pair: pair[0] != pair[1]))
def test_one_image_token_at_the_end_of_a_chunk_tells_images_apart(images: tuple[str, str]) -> None:
    spec = KeySpec("tiny", block_size=4, chunk_size=8)
    tokens = text_with_image(7, 64, 0)
    key_a = chunk_keys(tokens, [MMItem(images[0], 7, 64)], spec)[0]
    key_b = chunk_keys(tokens, [MMItem(images[1], 7, 64)], spec)[0]
    assert key_a != key_b


def test_a_uuid_identifier_works_like_a_hex_hash() -> None:
    spec = KeySpec("tiny", block_size=4, chunk_size=8)
    tokens = text_with_image(3, 20, 5)
    first = chunk_keys(tokens, [MMItem("user-photo-2f9c1b7e", 3, 20)], spec)
    again = chunk_keys(tokens, [MMItem("user-photo-2f9c1b7e", 3, 20)], spec)
    other = chunk_keys(tokens, [MMItem("user-photo-2f9c1b7f", 3, 20)], spec)
    assert first == again
    assert all(a != b for a, b in zip(first, other, strict=True))


PINNED_CHANGES: list[tuple[str, Any]] = [
    ("model_id", "tiny-2"),
    ("model_revision", "main"),
    ("kv_dtype", "float16"),
    ("kv_layout", "cpu:[blocks,kv_heads,block,2*head]"),
    ("block_size", 2),
    ("chunk_size", 4),
    ("tp_rank", 1),
    ("tp_world_size", 4),
    ("pp_rank", 1),
    ("pp_world_size", 4),
    ("hash_algo", "xxh3_128"),
    ("salt", "team-a"),
]


@pytest.mark.parametrize(("field", "value"), PINNED_CHANGES, ids=[f for f, _ in PINNED_CHANGES])
@settings(UNTIMED, max_examples=20)
@given(prompt=prompts())
def test_changing_any_pinned_field_changes_every_key(
    field: str, value: Any, prompt: tuple[list[int], list[MMItem]]
) -> None:
    tokens, items = prompt
    spec = KeySpec("tiny", block_size=4, chunk_size=8, tp_world_size=2, pp_world_size=2)
    changed = replace(spec, **{field: value})
    assert set(chunk_keys(tokens, items, spec)).isdisjoint(chunk_keys(tokens, items, changed))


REQUEST_CHANGES: list[dict[str, str]] = [
    {"cache_salt": "tenant-a"},
    {"lora_name": "sql-adapter"},
    {"lora_path": "/adapters/sql"},
]


@pytest.mark.parametrize("fields", REQUEST_CHANGES, ids=lambda fields: next(iter(fields)))
@settings(UNTIMED, max_examples=20)
@given(prompt=prompts())
def test_changing_a_request_field_changes_every_key(
    fields: dict[str, str], prompt: tuple[list[int], list[MMItem]]
) -> None:
    tokens, items = prompt
    spec = KeySpec("tiny", block_size=4, chunk_size=8)
    plain = KeyChain(spec, items).extend(tokens)
    assert set(plain).isdisjoint(KeyChain(spec, items, **fields).extend(tokens))


def test_no_salt_and_an_empty_salt_give_the_same_keys() -> None:
    spec = KeySpec("tiny", block_size=4, chunk_size=8)
    assert chunk_keys(range(32), [], spec, None) == chunk_keys(range(32), [], spec, "")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"model_id": "org_1", "model_revision": "2345"}, {"model_id": "org_12345"}),
        ({"kv_dtype": "bf", "kv_layout": "16"}, {"kv_dtype": "bf16", "kv_layout": ""}),
    ],
    ids=["model_id-revision", "dtype-layout"],
)
def test_fields_with_a_shifted_boundary_give_different_keys(
    first: dict[str, str], second: dict[str, str]
) -> None:
    base = {"block_size": 4, "chunk_size": 8}
    keys_first = chunk_keys(range(16), [], KeySpec(**{"model_id": "m", **base, **first}))
    keys_second = chunk_keys(range(16), [], KeySpec(**{"model_id": "m", **base, **second}))
    assert set(keys_first).isdisjoint(keys_second)


def test_engine_salt_and_request_salt_with_a_shifted_boundary_give_different_keys() -> None:
    """salt "a" + cache_salt "bc" is not salt "ab" + cache_salt "c"."""
    base = KeySpec("tiny", block_size=4, chunk_size=8)
    first = chunk_keys(range(16), [], replace(base, salt="a"), "bc")
    second = chunk_keys(range(16), [], replace(base, salt="ab"), "c")
    concatenated = chunk_keys(range(16), [], base, "abc")
    assert len({*first, *second, *concatenated}) == 3 * len(first)


def test_request_fields_with_a_shifted_boundary_give_different_keys() -> None:
    spec = KeySpec("tiny", block_size=4, chunk_size=8)
    salted = chunk_keys(range(16), [], spec, "org_1", lora_name="2345")
    shifted = chunk_keys(range(16), [], spec, "org_12345", lora_name="")
    assert set(salted).isdisjoint(shifted)


@UNTIMED
@given(small_specs(), prompts(), st.integers(0, 200))
def test_the_keys_of_a_prefix_are_a_prefix_of_the_keys(
    spec: KeySpec, prompt: tuple[list[int], list[MMItem]], cut: int
) -> None:
    tokens, items = prompt
    full = chunk_keys(tokens, items, spec)
    prefix = chunk_keys(tokens[:cut], items, spec)
    assert prefix == full[: len(prefix)]
    assert len(prefix) == min(cut, len(tokens)) // spec.chunk_size


@UNTIMED
@given(small_specs(), prompts(), st.lists(st.integers(0, 200), max_size=5))
def test_extending_a_chain_in_pieces_gives_the_keys_of_one_call(
    spec: KeySpec, prompt: tuple[list[int], list[MMItem]], cuts: list[int]
) -> None:
    tokens, items = prompt
    chain = KeyChain(spec, items)
    pieces: list[bytes] = []
    bounds = [0, *sorted(cuts), len(tokens)]
    for start, stop in pairwise(bounds):
        pieces += chain.extend(tokens[start:stop])
    assert pieces == chunk_keys(tokens, items, spec)
    assert chain.keys == tuple(pieces)
    assert chain.num_tokens == len(tokens)


def test_an_image_past_the_end_of_the_full_chunks_does_not_change_keys() -> None:
    spec = KeySpec("tiny", block_size=4, chunk_size=8)
    tokens = text_with_image(17, 40, 0)
    assert chunk_keys(tokens[:20], [MMItem(IMAGE_A, 17, 40)], spec) == chunk_keys(
        tokens[:20], [], spec
    )


@pytest.mark.parametrize(("count", "expected"), [(0, 0), (7, 0), (8, 1), (15, 1), (16, 2)])
def test_only_full_chunks_get_keys(count: int, expected: int) -> None:
    spec = KeySpec("tiny", block_size=4, chunk_size=8)
    assert len(chunk_keys(range(count), [], spec)) == expected


def test_a_list_a_tuple_and_an_array_of_token_ids_give_the_same_keys() -> None:
    spec = KeySpec("tiny", block_size=4, chunk_size=8)
    tokens = [5, 2**32 - 1, 0, 9] * 8
    keys = chunk_keys(tokens, [], spec)
    assert chunk_keys(tuple(tokens), [], spec) == keys
    assert chunk_keys(array("I", tokens), [], spec) == keys
    assert chunk_keys(array("q", tokens), [], spec) == keys
    assert chunk_keys(pack_token_ids(tokens), [], spec) == keys


def test_token_ids_may_be_any_ints_an_array_of_u32_accepts() -> None:
    class TokenId:
        def __index__(self) -> int:
            return 7

    spec = KeySpec("tiny", block_size=4, chunk_size=8)
    given_ids: list[Any] = [TokenId(), True, 2**30, 2**31 + 5]
    assert chunk_keys(given_ids * 2, [], spec) == chunk_keys([7, 1, 2**30, 2**31 + 5] * 2, [], spec)


@pytest.mark.parametrize("bad", [1.5, "7", None, 2**64])
def test_a_token_id_that_is_not_a_u32_int_is_rejected(bad: Any) -> None:
    with pytest.raises(ValueError, match="token_ids"):
        chunk_keys([1, bad] * 4, [], KeySpec("tiny", block_size=4, chunk_size=8))


def test_the_c_helper_is_built() -> None:
    """scripts/setup builds it (gcc, Python headers, libssl-dev, libxxhash-dev): without
    it keys are the same bytes, computed about twice as slowly."""
    helper = importlib.import_module("kvtier.connector.chunks._keyhash")
    assert helper.pack_u32([1, 2**32 - 1]) == array("I", [1, 2**32 - 1]).tobytes()


@pytest.mark.parametrize(
    ("algo", "data", "chunk_bytes", "error"),
    [("md5", b"", 4, "algo must be"), ("sha256", b"12345", 4, "whole chunks")],
)
def test_the_c_helper_refuses_what_keys_never_asks(
    algo: str, data: bytes, chunk_bytes: int, error: str
) -> None:
    helper = importlib.import_module("kvtier.connector.chunks._keyhash")
    with pytest.raises(ValueError, match=error):
        helper.chain(algo, b"", b"", data, chunk_bytes, 0, {})


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_keys_have_the_size_of_the_hash_algorithm(algo: str) -> None:
    spec = KeySpec("tiny", hash_algo=algo)
    keys = chunk_keys(range(512), [MMItem(IMAGE_A, 100, 300)], spec)
    assert {len(key) for key in keys} == {spec.key_size}
    assert spec.key_size == {"sha256": 32, "xxh3_128": 16}[algo]


def test_a_key_spec_is_a_value_that_survives_pickling() -> None:
    spec = KeySpec("tiny", kv_layout="x")
    chunk_keys(range(256), [], spec)  # warm the per-spec hasher cache
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_the_default_hash_algorithm_is_sha256() -> None:
    assert KeySpec("tiny").hash_algo == "sha256"


def test_a_chunk_size_that_is_not_a_multiple_of_the_block_size_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"chunk_size=100 must be a multiple of .*block_size=16"):
        KeySpec("tiny", block_size=16, chunk_size=100)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model_id", ""),
        ("kv_dtype", ""),
        ("kv_layout", None),
        ("block_size", 0),
        ("chunk_size", True),
        ("tp_rank", 2),
        ("tp_world_size", 0),
        ("pp_rank", -1),
        ("hash_algo", "md5"),
    ],
)
def test_an_invalid_spec_value_is_rejected_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"KeySpec.{field}"):
        replace(KeySpec("tiny", tp_world_size=2), **{field: value})


def test_overlapping_items_are_rejected() -> None:
    items = [MMItem(IMAGE_A, 0, 10), MMItem(IMAGE_B, 9, 10)]
    with pytest.raises(ValueError, match="overlap"):
        KeyChain(KeySpec("tiny"), items)


@pytest.mark.parametrize(
    ("identifier", "offset", "length", "field"),
    [("", 0, 1, "identifier"), (IMAGE_A, -1, 1, "offset"), (IMAGE_A, 0, 0, "length")],
)
def test_an_invalid_item_is_rejected_naming_the_field(
    identifier: str, offset: int, length: int, field: str
) -> None:
    with pytest.raises(ValueError, match=f"MMItem.{field}"):
        MMItem(identifier, offset, length)


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_a_token_id_outside_u32_is_rejected_and_leaves_the_chain_unchanged(bad: int) -> None:
    spec = KeySpec("tiny", block_size=4, chunk_size=8)
    chain = KeyChain(spec)
    chain.extend([1, 2, 3])
    with pytest.raises(ValueError, match="token_ids"):
        chain.extend([4, bad])
    assert chain.num_tokens == 3
    assert chain.extend(range(4, 9)) == chunk_keys(range(1, 9), [], spec)


def test_one_packed_prompt_extends_the_chains_of_several_ranks() -> None:
    specs = [KeySpec("tiny", tp_rank=rank, tp_world_size=2) for rank in (0, 1)]
    tokens = text_with_image(100, 300, 200)
    items = [MMItem(IMAGE_A, 100, 300)]
    packed = pack_token_ids(tokens)
    per_rank = [KeyChain(spec, items).extend(packed) for spec in specs]
    assert per_rank == [chunk_keys(tokens, items, spec) for spec in specs]
    assert list(packed) == tokens


def test_packing_a_token_id_outside_u32_is_rejected() -> None:
    with pytest.raises(ValueError, match="token_ids"):
        pack_token_ids([1, -5])


def test_key_fingerprints_are_16_bytes_and_differ_between_keys() -> None:
    keys = chunk_keys(range(4096), [], KeySpec("tiny"))
    fingerprints = {key_fingerprint(key) for key in keys}
    assert len(fingerprints) == len(keys)
    assert {len(fingerprint) for fingerprint in fingerprints} == {16}


def test_keys_are_identical_in_interpreters_with_different_hash_seeds() -> None:
    script = (
        "from kvtier.connector.chunks.keys import KeySpec, MMItem, chunk_keys\n"
        "items = [MMItem('user-uuid-1', 300, 200), MMItem('" + IMAGE_A + "', 600, 256)]\n"
        "keys = chunk_keys(range(1024), items, KeySpec('m', kv_layout='x'), 'salt')\n"
        "print(','.join(key.hex() for key in keys))\n"
    )
    outputs = set()
    for seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(done.stdout.strip())
    items = [MMItem("user-uuid-1", 300, 200), MMItem(IMAGE_A, 600, 256)]
    here = chunk_keys(range(1024), items, KeySpec("m", kv_layout="x"), "salt")
    assert outputs == {",".join(key.hex() for key in here)}


def reference_keys(
    tokens: list[int], items: list[MMItem], spec: KeySpec, salt: str = ""
) -> list[bytes]:
    """docs/keys.md's scheme written plainly, without any of the module's shortcuts."""

    def field(name: str, value: object) -> bytes:
        raw_name, raw_value = name.encode(), str(value).encode("utf-8", "surrogatepass")
        return (
            struct.pack("<I", len(raw_name))
            + raw_name
            + struct.pack("<I", len(raw_value))
            + raw_value
        )

    pinned = [("kvtier", "chunk-key"), ("key_schema_version", KEY_SCHEMA_VERSION)]
    pinned += [(name, getattr(spec, name)) for name in ("model_id", "model_revision", "kv_dtype")]
    pinned += [(name, getattr(spec, name)) for name in ("kv_layout", "block_size", "chunk_size")]
    pinned += [(name, getattr(spec, name)) for name in ("tp_rank", "tp_world_size", "pp_rank")]
    pinned += [("pp_world_size", spec.pp_world_size), ("hash_algo", spec.hash_algo)]
    pinned += [("salt", spec.salt)]
    prefix = b"".join(field(name, value) for name, value in pinned)
    prefix += field("cache_salt", salt) + field("lora_name", "") + field("lora_path", "")
    values, digests = list(tokens), {}
    for item in items:
        seed = field("kvtier", "mm-item") + field("identifier", item.identifier)
        material = hashlib.shake_256(seed).digest(32 + 4 * item.length)
        digests[item] = material[:32]
        for j in range(item.length):
            if item.offset + j < len(values):
                word = int.from_bytes(material[32 + 4 * j : 36 + 4 * j], "little")
                values[item.offset + j] = word | 0x80000000
    size, parent, keys = spec.chunk_size, b"", []
    for start in range(0, len(values) - size + 1, size):
        inside = sorted(
            (item for item in items if item.offset < start + size and item.end > start),
            key=lambda item: item.offset,
        )
        message = prefix + bytes([len(parent)]) + parent + struct.pack("<H", len(inside))
        message += b"".join(
            digests[item] + struct.pack("<q", item.offset - start) for item in inside
        )
        message += struct.pack(f"<{size}I", *values[start : start + size])
        if spec.hash_algo == "sha256":
            parent = hashlib.sha256(message).digest()
        else:
            parent = xxhash.xxh3_128_digest(message)
        keys.append(parent)
    return keys


@UNTIMED
@given(small_specs(), prompts(), st.sampled_from(HASH_ALGOS), st.text(max_size=4))
def test_keys_follow_the_documented_scheme(
    spec: KeySpec, prompt: tuple[list[int], list[MMItem]], algo: str, salt: str
) -> None:
    tokens, items = prompt
    spec = replace(spec, hash_algo=algo)
    assert chunk_keys(tokens, items, spec, salt) == reference_keys(tokens, items, spec, salt)


# -- committed test vectors ---------------------------------------------------


def vector_keys(vector: dict[str, Any]) -> list[str]:
    items = [MMItem(**item) for item in vector["mm_items"]]
    chain = KeyChain(KeySpec(**vector["spec"]), items, **vector["request"])
    return [key.hex() for key in chain.extend(vector["token_ids"])]


def test_the_vectors_file_pins_the_current_key_schema_version() -> None:
    pinned = json.loads(VECTORS.read_text())["key_schema_version"]
    assert pinned == KEY_SCHEMA_VERSION, (
        "KEY_SCHEMA_VERSION changed: rewrite the vectors with "
        "`python -m tests.connector.test_keys --write-vectors`"
    )


def test_docs_keys_md_describes_the_current_key_schema_version() -> None:
    page = (Path(__file__).parents[2] / "docs" / "keys.md").read_text()
    assert f"`KEY_SCHEMA_VERSION = {KEY_SCHEMA_VERSION}`" in page
    assert f'field("key_schema_version", "{KEY_SCHEMA_VERSION}")' in page


def test_keys_match_the_committed_vectors() -> None:
    for vector in json.loads(VECTORS.read_text())["vectors"]:
        assert vector_keys(vector) == vector["keys"], (
            f"vector {vector['name']!r}: the key scheme changed. If that is intended, bump "
            "KEY_SCHEMA_VERSION and rewrite the vectors (see this module's docstring)"
        )


def vector_inputs() -> list[dict[str, Any]]:
    """The inputs of the committed vectors: small chunks, images across boundaries."""
    tiny = {"model_id": "Qwen/Qwen2-VL-2B-Instruct", "block_size": 4, "chunk_size": 8}
    text = [(i * 7919) % 151936 for i in range(40)]
    image = text[:5] + [PLACEHOLDER] * 19 + text[24:]
    two = text[:3] + [PLACEHOLDER] * 6 + text[9:10] + [PLACEHOLDER] * 14 + text[24:]
    none: dict[str, str] = {}
    return [
        {"name": "text", "spec": tiny, "request": none, "mm_items": [], "token_ids": text},
        {
            "name": "text, salt and lora",
            "spec": tiny,
            "request": {"cache_salt": "tenant-a", "lora_name": "sql", "lora_path": "/a/sql"},
            "mm_items": [],
            "token_ids": text,
        },
        {
            "name": "every pinned field set",
            "spec": {
                **tiny,
                "model_revision": "895c3a4",
                "kv_dtype": "float16",
                "kv_layout": "cpu:[blocks,kv_heads,block,2*head]",
                "tp_rank": 1,
                "tp_world_size": 2,
                "pp_rank": 1,
                "pp_world_size": 3,
                "salt": "team-a",
            },
            "request": none,
            "mm_items": [],
            "token_ids": text,
        },
        {
            "name": "hex image across chunk boundaries",
            "spec": tiny,
            "request": none,
            "mm_items": [{"identifier": IMAGE_A, "offset": 5, "length": 19}],
            "token_ids": image,
        },
        {
            "name": "uuid and hex images, span cut by the prefix end",
            "spec": tiny,
            "request": none,
            "mm_items": [
                {"identifier": "0c7f3e52-9d1a-4b8e-a1f0-5d2c6b9e8a47", "offset": 3, "length": 6},
                {"identifier": IMAGE_B, "offset": 10, "length": 40},
            ],
            "token_ids": two,
        },
        {
            "name": "xxh3_128",
            "spec": {**tiny, "hash_algo": "xxh3_128"},
            "request": none,
            "mm_items": [{"identifier": IMAGE_A, "offset": 5, "length": 19}],
            "token_ids": image,
        },
        {
            "name": "default spec, 256-token chunks",
            "spec": {"model_id": "Qwen/Qwen2-VL-2B-Instruct"},
            "request": {"cache_salt": "s"},
            "mm_items": [{"identifier": IMAGE_A, "offset": 200, "length": 324}],
            "token_ids": [(i * 7919) % 151936 for i in range(200)]
            + [PLACEHOLDER] * 324
            + list(range(100)),
        },
    ]


def unbumped_changes(committed: dict[str, Any], vectors: list[dict[str, Any]]) -> list[str]:
    """Names of vectors whose keys changed while KEY_SCHEMA_VERSION stayed the same."""
    if committed["key_schema_version"] != KEY_SCHEMA_VERSION:
        return []
    before = {vector["name"]: vector["keys"] for vector in committed["vectors"]}
    return [v["name"] for v in vectors if v["name"] in before and before[v["name"]] != v["keys"]]


def test_rewriting_vectors_whose_keys_changed_needs_a_version_bump() -> None:
    committed = json.loads(VECTORS.read_text())
    changed = [{**committed["vectors"][0], "keys": ["00" * 32]}, *committed["vectors"][1:]]
    assert unbumped_changes(committed, changed) == [committed["vectors"][0]["name"]]
    assert unbumped_changes(committed, committed["vectors"]) == []
    assert unbumped_changes({**committed, "key_schema_version": -1}, changed) == []


def write_vectors() -> None:
    vectors = [{**vector, "keys": vector_keys(vector)} for vector in vector_inputs()]
    changed = unbumped_changes(json.loads(VECTORS.read_text()), vectors)
    if changed:
        sys.exit(
            f"the keys of {', '.join(map(repr, changed))} changed but KEY_SCHEMA_VERSION is "
            f"still {KEY_SCHEMA_VERSION}: bump it in connector/kvtier/connector/keys.py first (old entries must miss)"
        )
    lines = ",\n".join(json.dumps(vector) for vector in vectors)
    VECTORS.write_text(
        f'{{"key_schema_version": {KEY_SCHEMA_VERSION}, "vectors": [\n{lines}\n]}}\n'
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-vectors"]:
        sys.exit("usage: python -m tests.connector.test_keys --write-vectors")
    write_vectors()
