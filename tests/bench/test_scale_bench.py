"""The scale harness (kvtier/bench/scale.py) runs end to end in its --tiny mode.

A smoke test, not a speed test: every part runs on real tier processes, reports
well-formed figures and behaves as its description says (a working set larger than
RAM is served from RAM and disk, with evictions). No latency or throughput is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench") / "scale.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "scale", "--tiny", "--json", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_key_count_reports_metadata_and_latency_percentiles(tiny_run: tuple[dict[str, Any], str]) -> None:
    data, _ = tiny_run
    assert [r["keys"] for r in data["keys"]] == [200, 1000]
    for r in data["keys"]:
        assert r["rss_growth_bytes"] > 0 and r["fill_keys_per_s"] > 0
        assert 0 < r["lookup_p50_us"] <= r["lookup_p99_us"]
        assert 0 < r["get_p50_us"] <= r["get_p99_us"]


def test_every_client_count_reads_and_reports_throughput(tiny_run: tuple[dict[str, Any], str]) -> None:
    data, _ = tiny_run
    assert [r["clients"] for r in data["clients"]] == [1, 3]
    for r in data["clients"]:
        assert r["failed_clients"] == 0 and r["ops_per_s"] > 0 and r["gb_per_s"] > 0
        assert 0 < r["get_p50_ms"] <= r["get_p99_ms"]


def test_a_working_set_larger_than_ram_is_served_from_ram_and_disk_with_evictions(
    tiny_run: tuple[dict[str, Any], str],
) -> None:
    data, _ = tiny_run
    fits, spills = data["working_set"]["all in RAM"], data["working_set"]["10x RAM"]
    assert fits["keys"] == spills["keys"] and fits["working_set_bytes"] >= 10 * (1 << 20)
    assert fits["ram_evictions"] == 0 and fits["ram_hit_rate"] > 0.99
    assert spills["ram_evictions"] > 0 and spills["ram_hit_rate"] < 0.5
    assert spills["hit_rate_min"] > 0.5  # the disk tier answers what RAM evicted
    assert all(w["gets"] > 0 for w in spills["windows"])


def test_markdown_names_every_part(tiny_run: tuple[dict[str, Any], str]) -> None:
    _, stdout = tiny_run
    for heading in ("RAM-tier keys", "Concurrent clients", "Working set 10x RAM"):
        assert heading in stdout
    assert all(line.count("|") >= 6 for line in stdout.splitlines() if line.startswith("| "))
