"""Benchmark: kvtier's chunk keys against vLLM's own block hashes, same prompt, one run.

The prompt: 32,768 token ids with four 1,024-token images (Qwen2-VL placeholders,
64-hex identifiers). kvtier hashes it into 128 chunks of 256 tokens, with its C
helper (kvtier.connector.chunks._keyhash) and with the pure-Python code that replaces it
where it is not built; vLLM into blocks of the same block size (16) with its default
sha256 and its xxhash option, and, for the same granularity, into 256-token blocks.
Every row starts from a Python list of token ids (as vLLM holds them) unless it says
"packed", and computes the whole chain, nothing reused. Only ratios within one run
mean anything on a shared machine.

``--hash-options`` adds the hashes a key chain could be built from, over the same
packed tokens: one SHA-256 (hashlib) and one BLAKE3 (the ``blake3`` package vLLM
brings) per 1 KiB chunk, 128 calls, and one BLAKE3 over the whole 128 KiB.

Run: ``.venv/bin/python -m kvtier.bench.keys`` (results: docs/benchmarks.md, "Keys").
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time
import timeit
from array import array
from collections.abc import Callable
from functools import partial

import xxhash

from kvtier.connector.chunks import keys
from kvtier.connector.chunks.keys import KeySpec, MMItem, chunk_keys

PROMPT_TOKENS = 32_768
IMAGE_TOKENS = 1_024
IMAGE_OFFSETS = (1_000, 9_000, 17_000, 25_000)
PLACEHOLDER = 151_655
BLOCK_SIZE = 16


def make_prompt() -> tuple[list[int], list[MMItem]]:
    rng = random.Random(0)
    tokens = [rng.randrange(151_000) for _ in range(PROMPT_TOKENS)]
    items = []
    for offset in IMAGE_OFFSETS:
        tokens[offset : offset + IMAGE_TOKENS] = [PLACEHOLDER] * IMAGE_TOKENS
        items.append(MMItem(rng.randbytes(32).hex(), offset, IMAGE_TOKENS))
    return tokens, items


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
"""``cpu``: this thread's CPU time, which leaves out the time other processes on a shared
machine take the core away (it still includes their cache pollution); ``wall``: elapsed."""


def measure(
    rows: list[tuple[str, Callable[[], object]]], repeat: int, clock: Callable[[], float]
) -> list[list[float]]:
    """Microseconds per call of each row; rows take turns, so load spikes hit them all."""
    timers = [timeit.Timer(run, timer=clock) for _, run in rows]
    numbers = []
    for timer in timers:
        timer.timeit(1)  # warm up (e.g. each image's placeholder values, cached as in an engine)
        numbers.append(max(1, int(0.02 / max(timer.timeit(1), 1e-6))))
    times: list[list[float]] = [[] for _ in rows]
    for _ in range(repeat):
        for timer, number, row_times in zip(timers, numbers, times, strict=True):
            row_times.append(timer.timeit(number) / number * 1e6)
    return times


def pure_python(run: Callable[[], object]) -> Callable[[], object]:
    """``run`` without the C helper, as on a machine where it is not built."""

    def without_helper() -> object:
        helper, keys._keyhash = keys._keyhash, None
        try:
            return run()
        finally:
            keys._keyhash = helper

    return without_helper


def vllm_hasher(
    tokens: list[int], items: list[MMItem], block_size: int, algo: str
) -> Callable[[], object]:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=item.identifier,
            mm_position=PlaceholderRange(offset=item.offset, length=item.length),
            mm_hash=item.identifier,
        )
        for item in items
    ]
    hasher = get_request_block_hasher(block_size, hash_fn)
    request = Request("bench", tokens, SamplingParams(), None, mm_features=features)
    return lambda: hasher(request)  # every block: the request holds no block hashes yet


def hash_option_rows(raw: bytes) -> list[tuple[str, Callable[[], object]]]:
    """One hash per 256-token chunk (1 KiB packed), as a key chain needs, and one BLAKE3
    over everything (module doc)."""
    import blake3  # vLLM's dependency, in the venv

    size = 256 * 4
    pieces = [raw[i : i + size] for i in range(0, len(raw), size)]

    def sha256_chain() -> object:
        return [hashlib.sha256(p).digest() for p in pieces]

    def blake3_chain() -> object:
        return [blake3.blake3(p).digest() for p in pieces]

    return [
        (f"sha256 (hashlib) per 1 KiB chunk, {len(pieces)} calls", sha256_chain),
        (f"blake3 per 1 KiB chunk, {len(pieces)} calls", blake3_chain),
        ("one blake3 over the packed tokens (128 KiB)", lambda: blake3.blake3(raw).digest()),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM rows")
    parser.add_argument(
        "--hash-options", action="store_true", help="add per-chunk sha256 and BLAKE3 rows"
    )
    parser.add_argument(
        "--clock", choices=CLOCKS, default="cpu", help="cpu: thread CPU time (default); wall"
    )
    args = parser.parse_args()

    if keys._keyhash is None:
        parser.error("kvtier.connector.chunks._keyhash is not built: run scripts/setup")
    tokens, items = make_prompt()
    packed = array("I", tokens)
    rows: list[tuple[str, Callable[[], object]]] = []
    for algo in ("sha256", "xxh3_128"):
        spec = KeySpec("bench/model", block_size=BLOCK_SIZE, hash_algo=algo)
        run = partial(chunk_keys, tokens, items, spec)
        rows += [
            (f"kvtier chunk_keys, {algo}", run),
            (
                f"kvtier chunk_keys, {algo}, tokens given packed",
                partial(chunk_keys, packed, items, spec),
            ),
            (f"kvtier chunk_keys, {algo}, pure Python", pure_python(run)),
        ]
    raw = packed.tobytes()
    rows += [
        ("packing the token list alone (C helper)", partial(keys._keyhash.pack_u32, tokens)),
        ("packing the token list alone (array.fromlist)", lambda: array("I").fromlist(tokens)),
        ("one sha256 over the packed tokens (128 KiB)", lambda: hashlib.sha256(raw).digest()),
        ("one xxh3_128 over the packed tokens (128 KiB)", partial(xxhash.xxh3_128_digest, raw)),
    ]
    if args.hash_options:
        rows += hash_option_rows(raw)
    if not args.no_vllm:
        for algo, block_size in (
            ("sha256", BLOCK_SIZE),
            ("sha256", 256),
            ("xxhash", BLOCK_SIZE),
            ("xxhash", 256),
        ):
            name = f"vLLM block hasher, {algo}, block {block_size}"
            rows.append((name, vllm_hasher(tokens, items, block_size, algo)))
    times = measure(rows, args.repeat, CLOCKS[args.clock])
    baseline = statistics.median(times[0])
    print(
        f"{PROMPT_TOKENS} tokens, {len(items)} images x {IMAGE_TOKENS} tokens, "
        f"{args.repeat} rounds, {args.clock} clock"
    )
    print("| what | median µs | best µs | median / first row |")
    print("|---|---:|---:|---:|")
    for (name, _), row_times in zip(rows, times, strict=True):
        median = statistics.median(row_times)
        print(f"| {name} | {median:.0f} | {min(row_times):.0f} | {median / baseline:.2f} |")


if __name__ == "__main__":
    main()
