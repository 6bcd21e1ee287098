"""The receive-buffer harness (kvtier/bench/alloc.py) runs through ``kvtier bench alloc``.

No time is asserted (speed is a benchmark's business): every row is measured and
printed as a well-formed table.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROWS = [
    "fresh bytearray, filled",
    "kept bytearray, filled",
    "fresh bytearray alone",
    "mmap MAP_POPULATE, filled",
]


def test_every_way_of_receiving_a_value_is_timed_in_one_table() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "alloc", "--mib", "2", "--repeat", "2"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("2 MiB values, 2 rounds")
    assert lines[1:3] == ["| what | median ms | best ms |", "|---|---:|---:|"]
    names = [line.split(" | ")[0].removeprefix("| ") for line in lines[3:]]
    assert names == ROWS
    for line in lines[3:]:
        median, best = (float(c) for c in line.strip("| ").split(" | ")[1:])
        assert 0 <= best <= median


def test_a_value_size_below_one_mib_is_refused_naming_the_flag() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "alloc", "--mib", "0"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--mib" in proc.stderr
