"""The file-replacement harness (kvtier/bench/replace.py) runs through ``kvtier bench replace``.

No time is asserted (speed is a benchmark's business): every way of replacing a file is
measured at 1 and 4 threads and printed as a well-formed table, and the harness leaves
nothing behind in the directory it was given.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "replace", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


def test_every_way_of_replacing_a_file_is_measured_and_nothing_is_left_behind(tmp_path: Path) -> None:
    proc = bench("--mib", "1", "--keys", "2", "--rounds", "2", "--repeat", "1", "--dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("1 MiB values, 2 files per thread rewritten 2 times, 1 runs")
    assert lines[1:3] == ["| how | threads | GB/s | MiB written to devices |", "|---|---:|---:|---:|"]
    rows = [line.strip("| ").split(" | ") for line in lines[3:]]
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        (how, threads) for how in ("rename over", "swap names", "truncate, rewrite") for threads in ("1", "4")
    )
    for _, _, rate, written in rows:
        low, high = (float(x) for x in rate.split("-"))
        assert 0 < low <= high
        assert all(float(x) >= 0 for x in written.split("-"))
    assert list(tmp_path.iterdir()) == []
    assert "[replace] 1/1 swap names x4" in proc.stderr  # progress on stderr


def test_a_count_below_one_is_refused_naming_the_flag(tmp_path: Path) -> None:
    proc = bench("--keys", "0", "--dir", str(tmp_path))
    assert proc.returncode == 2
    assert "--keys" in proc.stderr
