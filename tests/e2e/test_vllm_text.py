"""Text prompts across two vLLM processes that share only the tier.

Engine A computes and saves; engine B, a separate process, loads. A run with a
fresh ``cache_salt`` misses every key, so it is the no-cache reference.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import xxhash

from kvtier.connector.chunks.codec import decode_chunk, encode_chunk_bytes
from kvtier.connector.client import TierClient
from kvtier.testing.engine import EngineProcess
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import prompt_text
from tests.e2e.conftest import RELAXED

pytestmark = pytest.mark.vllm

CHUNK = 256
PROMPT_WORDS = 330  # about 960 tokens: 3 full chunks of 256, then a partial one


@pytest.fixture(scope="module")
def tier(module_dir: Path) -> Iterator[TierProcess]:
    # write-through: a saved chunk is on disk at once (the corruption test reads it there).
    tier = TierProcess.start(module_dir / "tier", "--write-policy", "write-through")
    yield tier
    tier.stop()


@pytest.fixture(scope="module")
def engines(
    text_model: Path, tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> tuple[EngineProcess, EngineProcess]:
    config = {"target": tier.target, "chunk_size": CHUNK, **RELAXED}
    a = start_engine(text_model, name="a", extra_config=config, wait=False)
    b = start_engine(text_model, name="b", extra_config=config, wait=False)
    a.wait_ready()
    b.wait_ready()
    return a, b


@pytest.fixture
def client(tier: TierProcess) -> Iterator[TierClient]:
    with TierClient(tier.target) as client:
        yield client


def saved_by_a(engines: tuple[EngineProcess, EngineProcess], seed: int) -> tuple[str, list[int]]:
    """A fresh prompt computed (and saved) by engine A: (prompt, A's greedy tokens)."""
    a, _ = engines
    prompt = prompt_text(PROMPT_WORDS, seed=seed)
    (out,) = a.generate([{"prompt": prompt}])
    assert out.num_cached_tokens == 0
    a.flush()
    return prompt, out.token_ids


def reference(engines: tuple[EngineProcess, EngineProcess], prompt: str) -> list[int]:
    """The no-cache output: a unique salt makes every key miss."""
    _, b = engines
    (out,) = b.generate([{"prompt": prompt, "cache_salt": f"reference-{prompt[:20]}"}])
    assert out.num_cached_tokens == 0
    return out.token_ids


def test_second_process_serves_prompt_from_tier_with_identical_output(engines) -> None:
    _, b = engines
    prompt, from_a = saved_by_a(engines, seed=1)

    (out,) = b.generate([{"prompt": prompt}])

    assert out.num_prompt_tokens > 3 * CHUNK
    assert out.num_cached_tokens == out.num_prompt_tokens // CHUNK * CHUNK
    assert out.token_ids == from_a == reference(engines, prompt)


def test_prompt_of_whole_chunks_recomputes_its_last_block(engines) -> None:
    """A full hit still leaves vLLM one block to compute (it must sample a token)."""
    a, b = engines
    ids = a.tokenize(prompt_text(PROMPT_WORDS, seed=2))[: 2 * CHUNK]
    (from_a,) = a.generate([{"prompt_token_ids": ids}])
    a.flush()

    (out,) = b.generate([{"prompt_token_ids": ids}])

    assert out.num_cached_tokens == 2 * CHUNK - 128  # the last 128-token block is recomputed
    assert out.token_ids == from_a.token_ids


def test_altered_chunk_in_tier_changes_output(engines, client: TierClient) -> None:
    """Negative control: KV that passes verification but is wrong changes the output,
    so the loaded KV is really what the model attends to."""
    import numpy as np

    _, b = engines
    prompt, expected = saved_by_a(engines, seed=3)
    keys = b.chunk_keys(prompt)
    assert client.lookup(keys) == len(keys) == 3
    rng = np.random.default_rng(0)
    for key, blob in zip(keys, client.get(keys), strict=True):
        assert blob is not None
        chunk = decode_chunk(key, blob)
        noise = rng.normal(0, 4, size=len(chunk.payload) // 2).astype(np.float32)
        bf16 = (noise.view(np.uint32) >> 16).astype(np.uint16)  # float32 -> bfloat16 bits
        forged = encode_chunk_bytes(key, bf16.tobytes(), dtype=chunk.dtype, shape=chunk.shape)
        assert client.put([(key, forged)]) == 1

    (out,) = b.generate([{"prompt": prompt}])

    assert out.num_cached_tokens == 3 * CHUNK
    assert out.token_ids != expected


def test_chunk_failing_its_checksum_is_recomputed_and_deleted(engines, client) -> None:
    _, b = engines
    prompt, expected = saved_by_a(engines, seed=4)
    keys = b.chunk_keys(prompt)
    blob = bytearray(client.get(keys[1:2])[0])
    blob[-100] ^= 0xFF  # one flipped payload bit pattern: the codec checksum fails
    assert client.put([(keys[1], bytes(blob))]) == 1
    before = b.stats()

    (out,) = b.generate([{"prompt": prompt}])
    b.flush()

    after = b.stats()
    assert out.token_ids == expected
    key = "corrupt_chunks:checksum"
    assert after.get(key, 0) == before.get(key, 0) + 1
    assert after.get("load_failed_blocks", 0) - before.get("load_failed_blocks", 0) == 4
    # The bad chunk was deleted, and stored again once B recomputed it.
    assert client.lookup(keys) == 3
    decode_chunk(keys[1], client.get(keys[1:2])[0])  # verifies


def test_chunks_computed_on_top_of_a_failed_load_are_stored_only_once_recomputed(
    engines, client: TierClient
) -> None:
    """A load that fails leaves its blocks as they were, and the forward of that step
    still computes the prompt's later tokens on top of them: vLLM recomputes only after
    the step, from the first failed block. The chunks that step completed are wrong KV
    under the right keys, so none of them is stored (counted as
    ``saves_dropped:load_failed``); the scheduler saves the prompt's chunks again once
    they are recomputed, and an engine that then loads every one of them gets the
    no-cache output."""
    a, b = engines
    short = prompt_text(PROMPT_WORDS, seed=9)
    long = short + " " + prompt_text(PROMPT_WORDS, seed=10)
    keys = b.chunk_keys(long)
    assert len(keys) >= 6 and keys[:3] == b.chunk_keys(short)
    a.generate([{"prompt": short}])
    a.flush()
    assert client.lookup(keys) == 3
    blob = bytearray(client.get(keys[1:2])[0])
    blob[-100] ^= 0xFF  # B loads chunk 0, chunk 1 fails its checksum (and chunk 2 with it)
    assert client.put([(keys[1], bytes(blob))]) == 1
    before = b.stats()

    (out,) = b.generate([{"prompt": long}])  # the failed load's step computes chunks 3 to 6
    b.flush()

    after = b.stats()
    expected = reference(engines, long)
    assert out.token_ids == expected
    dropped = "saves_dropped:load_failed"
    assert after.get(dropped, 0) - before.get(dropped, 0) == len(keys) - 3
    assert client.lookup(keys) == len(keys)  # chunk 1 on: saved again once recomputed
    before = a.stats()
    (again,) = a.generate([{"prompt": long}])
    after = a.stats()
    assert after.get("loaded_chunks", 0) - before.get("loaded_chunks", 0) == len(keys)
    assert again.token_ids == expected


def test_chunk_corrupted_on_tier_disk_is_recomputed(engines, tier: TierProcess) -> None:
    """Bytes flipped in the tier's files: the tier's own check turns them into misses."""
    _, b = engines
    prompt, expected = saved_by_a(engines, seed=5)
    tier.terminate()
    for record in (tier.directory / "disk" / "v1").glob("*/*"):
        data = bytearray(record.read_bytes())
        data[len(data) // 2] ^= 0xFF
        record.write_bytes(bytes(data))
    tier.restart()  # empty RAM: reads come from the corrupted files
    before = b.stats()

    (out,) = b.generate([{"prompt": prompt}])

    after = b.stats()
    assert out.token_ids == expected
    assert after.get("load_failed_blocks", 0) > before.get("load_failed_blocks", 0)


# -- the zstd codec --------------------------------------------------------------


@pytest.fixture(scope="module")
def zstd_writer(
    text_model: Path, tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> EngineProcess:
    """Engine Z stores its chunks zstd-compressed (``codec: zstd``); A and B use raw."""
    config = {"target": tier.target, "chunk_size": CHUNK, "codec": "zstd", **RELAXED}
    return start_engine(text_model, name="z", extra_config=config)


def saved_by_z(zstd_writer: EngineProcess, seed: int) -> tuple[str, list[int]]:
    prompt = prompt_text(PROMPT_WORDS, seed=seed)
    (out,) = zstd_writer.generate([{"prompt": prompt}])
    assert out.num_cached_tokens == 0
    zstd_writer.flush()
    return prompt, out.token_ids


def test_zstd_chunks_are_smaller_and_load_with_identical_output(
    engines, zstd_writer: EngineProcess, client: TierClient
) -> None:
    """The codec is in each chunk's header, not in its key: an engine configured raw
    reads zstd chunks."""
    _, b = engines
    prompt, from_z = saved_by_z(zstd_writer, seed=6)
    keys = b.chunk_keys(prompt)
    blobs = client.get(keys)
    assert len(blobs) == len(keys) == 3
    for key, blob in zip(keys, blobs, strict=True):
        assert blob is not None
        chunk = decode_chunk(key, blob)
        assert chunk.codec == "zstd"
        assert len(blob) < chunk.payload.nbytes  # compressed (ratios: docs/connector.md)

    (out,) = b.generate([{"prompt": prompt}])

    assert out.num_cached_tokens == 3 * CHUNK
    assert out.token_ids == from_z == reference(engines, prompt)


def test_zstd_chunk_that_passes_its_checksum_but_does_not_decode_is_never_loaded(
    engines, zstd_writer: EngineProcess, client: TierClient
) -> None:
    """A writer bug (junk compressed payload, valid checksum): a miss, counted by reason."""
    _, b = engines
    prompt, expected = saved_by_z(zstd_writer, seed=7)
    keys = b.chunk_keys(prompt)
    blob = bytearray(client.get(keys[1:2])[0])
    header_size = int.from_bytes(blob[6:8], "little")
    blob[header_size : header_size + 8] = b"not zstd"
    checksum = xxhash.xxh3_64(bytes(blob[: header_size - 8]) + bytes(blob[header_size:]))
    blob[header_size - 8 : header_size] = checksum.intdigest().to_bytes(8, "little")
    assert client.put([(keys[1], bytes(blob))]) == 1
    before = b.stats()

    (out,) = b.generate([{"prompt": prompt}])
    b.flush()

    after = b.stats()
    assert out.token_ids == expected
    assert after.get("corrupt_chunks:codec", 0) == before.get("corrupt_chunks:codec", 0) + 1
    assert after.get("load_failed_blocks", 0) - before.get("load_failed_blocks", 0) == 4
    assert client.lookup(keys) == 3  # deleted, and stored again once recomputed (raw)
    assert decode_chunk(keys[1], client.get(keys[1:2])[0]).codec == "raw"


def test_engine_with_a_salt_and_a_token_file_shares_nothing_with_unsalted_engines(
    engines, text_model: Path, tier: TierProcess, start_engine, tmp_path: Path
) -> None:
    """The operator's keys (``salt``: the namespace, ``auth_token_file``: a mounted
    Secret) start an engine; its keys differ from an unsalted engine's, and it hits its
    own entries."""
    token = tmp_path / "token"
    token.write_text("ignored-by-a-tier-without-auth\n")
    config = {
        "target": tier.target,
        "chunk_size": CHUNK,
        "salt": "team-a",
        "salt_policy": "request",
        "auth_token_file": str(token),
        **RELAXED,
    }
    salted = start_engine(text_model, name="s", extra_config=config)
    prompt, from_a = saved_by_a(engines, seed=8)

    (first,) = salted.generate([{"prompt": prompt}])
    salted.flush()
    (again,) = salted.generate([{"prompt": prompt}])

    assert first.num_cached_tokens == 0  # A's entries are not this salt's
    assert again.num_cached_tokens == 3 * CHUNK
    assert first.token_ids == again.token_ids == from_a


# -- KV holding NaN ----------------------------------------------------------------


def poisoned_copy(model: Path, out: Path) -> Path:
    """``model`` with NaN in layer 0's key bias: every key that layer computes is NaN, so
    the model's KV (and from it every output token) is NaN, while its keys stay ``model``'s."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for path in model.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(str(weights))
    tensors["model.layers.0.self_attn.k_proj.bias"][0] = float("nan")
    save_file(tensors, str(out / weights.name), metadata={"format": "pt"})
    return out


def test_kv_holding_nan_is_never_stored_so_no_other_engine_loads_it(
    engines, text_model: Path, tier: TierProcess, client: TierClient, start_engine, module_dir: Path
) -> None:
    """An engine whose KV went bad (here: a NaN weight) shares keys with healthy engines.
    Its chunks are refused before they reach the tier (``saves_dropped:nonfinite``), so an
    engine loading the same prompt computes it and gets the no-cache output. Before the
    check, B loaded the NaN chunks and generated token 0 throughout."""
    config = {"target": tier.target, "chunk_size": CHUNK, "model_id": str(text_model), **RELAXED}
    bad = start_engine(poisoned_copy(text_model, module_dir / "qwen2-tiny-nan"), name="nan", extra_config=config)
    _, b = engines
    prompt = prompt_text(PROMPT_WORDS, seed=11)
    keys = b.chunk_keys(prompt)
    assert bad.chunk_keys(prompt) == keys

    (garbage,) = bad.generate([{"prompt": prompt}])
    bad.flush()

    assert set(garbage.token_ids) == {0}  # the NaN is real: every token is 0
    (out,) = b.generate([{"prompt": prompt}])
    b.flush()
    expected = reference(engines, prompt)
    assert out.token_ids == expected
    assert set(out.token_ids) != {0}
    assert out.num_cached_tokens == 0
    assert bad.stats().get("saves_dropped:nonfinite", 0) == len(keys) == 3

    # A writer without the check (an older connector, another client of the tenant)
    # stores NaN in B's first chunk: A, which loads it, fails that chunk's verification
    # and recomputes. Loaded, it poisoned more than this request: vLLM's attention reads
    # every slot of the blocks it filled, so later requests on them generated 0 too.
    assert client.lookup(keys) == 3
    first = decode_chunk(keys[0], client.get(keys[:1])[0])
    payload = bytearray(first.payload)
    payload[64:66] = b"\xc0\x7f"  # a bfloat16 NaN
    assert client.put([(keys[0], encode_chunk_bytes(keys[0], bytes(payload), dtype=first.dtype, shape=first.shape))]) == 1
    a, _ = engines
    before = a.stats()

    (loaded,) = a.generate([{"prompt": prompt}])
    (after_it,) = a.generate([{"prompt": prompt, "cache_salt": "after-the-nan"}])

    assert loaded.token_ids == after_it.token_ids == expected
    assert a.stats().get("corrupt_chunks:nonfinite", 0) == before.get("corrupt_chunks:nonfinite", 0) + 1
    bad.close()  # the module's engines stay up until its end: free this one's memory now


@pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM's CPU fp8 KV cache needs x86 with AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py)",
)
def test_an_fp8_kv_cache_never_loads_a_nan(
    text_model: Path, tier: TierProcess, client: TierClient, start_engine
) -> None:
    """With fp8 KV caches (``kv_cache_dtype: fp8``) vLLM keeps uint8 bytes; the connector
    scans them as the platform's e4m3 (``vllmspec.value_dtypes``). A chunk whose bytes hold
    an e4m3 NaN (0x7F), stored by a writer that does not check, is refused at load. (A NaN
    weight does not make such bytes here: vLLM's CPU fp8 quantizer wrote finite bytes for it,
    and the outputs were wrong but not 0.)"""
    config = {"target": tier.target, "chunk_size": CHUNK, **RELAXED}
    fp8 = {"kv_cache_dtype": "fp8"}
    a = start_engine(text_model, name="fp8-a", extra_config=config, llm_kwargs=fp8, wait=False)
    b = start_engine(text_model, name="fp8-b", extra_config=config, llm_kwargs=fp8, wait=False)
    a.wait_ready()
    b.wait_ready()
    prompt = prompt_text(PROMPT_WORDS, seed=12)
    keys = b.chunk_keys(prompt)
    (saved,) = a.generate([{"prompt": prompt}])
    a.flush()
    assert client.lookup(keys) == 3
    first = decode_chunk(keys[0], client.get(keys[:1])[0])
    assert first.dtype == "uint8"
    payload = bytearray(first.payload)
    payload[100] = 0x7F  # an e4m3 NaN
    assert client.put([(keys[0], encode_chunk_bytes(keys[0], bytes(payload), dtype="uint8", shape=first.shape))]) == 1
    before = b.stats()

    (loaded,) = b.generate([{"prompt": prompt}])
    (after_it,) = b.generate([{"prompt": prompt, "cache_salt": "fp8-after-the-nan"}])

    assert loaded.token_ids == after_it.token_ids == saved.token_ids
    assert b.stats().get("corrupt_chunks:nonfinite", 0) == before.get("corrupt_chunks:nonfinite", 0) + 1
    for engine in (a, b):
        engine.begin_close()
