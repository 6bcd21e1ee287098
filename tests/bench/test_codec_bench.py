"""The codec harness (kvtier/bench/codec.py) runs through ``kvtier bench codec``.

No speed is asserted: the random run checks that each level's row is there and that
zstd gains on bf16 what its sign and exponent bits allow (and no more: mantissas are
noise); the engine run checks that the chunks measured are the ones a real vLLM engine
saved to a real tier.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_codec(tmp_path: Path, *args: str, timeout: float = 120) -> tuple[dict[str, Any], str]:
    out = tmp_path / "codec.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "codec", "--json", str(out), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_random_bf16_compresses_by_its_exponent_bits_at_every_level(tmp_path: Path) -> None:
    data, stdout = run_codec(tmp_path, "--no-engine", "--quick", "--levels", "1,3")

    rows = data["rows"]
    assert [(r["data"], r["level"]) for r in rows] == [
        ("random bf16, 128 KiB", 1), ("random bf16, 128 KiB", 3),
        ("random bf16, 4 MiB", 1), ("random bf16, 4 MiB", 3),
    ]  # fmt: skip
    for r in rows:
        assert 1.15 < r["ratio"] < 1.45, r  # normal(0, 1) in bf16: ~1.29
        assert r["compress_mb_s"] > 0 and r["decompress_mb_s"] > 0
        assert f"| {r['data']} | {r['pieces']} | {r['level']} | {r['ratio']:.2f} |" in stdout
    assert rows[0]["pieces"] * rows[0]["piece_bytes"] == 4 << 20


def test_bad_levels_are_refused_naming_the_flag(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "codec", "--no-engine", "--levels", "one"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--levels" in proc.stderr


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_chunks_are_every_full_chunk_a_real_engine_saved(tmp_path: Path) -> None:
    data, _ = run_codec(
        tmp_path, "--tiny", "--prompts", "1", "--prompt-words", "330", "--quick",
        "--levels", "1", "--work", str(tmp_path / "work"), timeout=900,
    )  # fmt: skip

    engine, *random = data["rows"]
    # The tiny Qwen2: 2 layers, 2 blocks of 128 tokens per chunk, 1 KV head, K and V
    # of 64 each, bf16 (docs/connector.md); ~960 tokens fill 3 chunks.
    assert engine["data"].startswith("qwen2-tiny KV chunks ([2, 2, 1, 128, 128] bfloat16")
    assert (engine["pieces"], engine["piece_bytes"]) == (3, 2 * 2 * 128 * 128 * 2)
    assert engine["ratio"] > 1.0
    assert [r["data"] for r in random] == ["random bf16, 128 KiB", "random bf16, 4 MiB"]
