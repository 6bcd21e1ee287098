"""The keys harness (kvtier/bench/keys.py) runs through ``kvtier bench keys``.

A smoke test, not a speed test: one round of every row (kvtier's chunk keys with
and without its C helper, and vLLM's own block hasher with sha256 and xxhash, on the
same 32k-token prompt with images) lands in a well-formed table. No time is asserted.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROWS = [
    "kvtier chunk_keys, sha256",
    "kvtier chunk_keys, sha256, tokens given packed",
    "kvtier chunk_keys, sha256, pure Python",
    "kvtier chunk_keys, xxh3_128",
    "kvtier chunk_keys, xxh3_128, tokens given packed",
    "kvtier chunk_keys, xxh3_128, pure Python",
    "packing the token list alone (C helper)",
    "packing the token list alone (array.fromlist)",
    "one sha256 over the packed tokens (128 KiB)",
    "one xxh3_128 over the packed tokens (128 KiB)",
    "vLLM block hasher, sha256, block 16",
    "vLLM block hasher, sha256, block 256",
    "vLLM block hasher, xxhash, block 16",
    "vLLM block hasher, xxhash, block 256",
]


def test_kvtier_bench_keys_prints_every_row_against_vllms_block_hasher() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "keys", "--repeat", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert table[0] == "| what | median µs | best µs | median / first row |"
    assert [row.split("|")[1].strip() for row in table[2:]] == ROWS
    assert table[2].endswith("| 1.00 |")
    for row in table[2:]:
        assert float(row.split("|")[2]) > 0


def test_hash_options_add_the_per_chunk_sha256_and_blake3_rows() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "keys", "--repeat", "1", "--no-vllm",
         "--hash-options"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    extra = [
        "sha256 (hashlib) per 1 KiB chunk, 128 calls",
        "blake3 per 1 KiB chunk, 128 calls",
        "one blake3 over the packed tokens (128 KiB)",
    ]
    assert [row.split("|")[1].strip() for row in table[2:]] == [*ROWS[:10], *extra]
