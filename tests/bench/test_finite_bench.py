"""The NaN-check cost harness (kvtier/bench/finite.py) runs through ``python -m``.

No time is asserted: every case is measured at every chunk size and printed as a
well-formed table, with the C scan in use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = [
    "scan (C)",
    "scan (C), at an odd address",
    "scan (numpy)",
    "xxh3-64",
    "encode_chunk raw",
    "encode_chunk raw, check_finite",
    "decode_chunk",
    "decode_chunk, then the scan",
]


def test_every_case_is_measured_at_every_chunk_size() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.bench.finite", "--repeat", "1"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:3] == ["C scan built: True", "| chunk | what | GB/s | us per chunk |", "|---|---|---:|---:|"]
    rows = [line.strip("| ").split(" | ") for line in lines[3:]]
    assert [(r[0], r[1]) for r in rows] == [(size, case) for size in ("128 KiB", "3 MiB", "16 MiB") for case in CASES]
    assert all(float(r[2]) > 0 and float(r[3]) >= 0 for r in rows)
