"""The GPU harness (kvtier/bench/gpu.py) runs on the CPU through ``kvtier bench gpu --device
cpu --quick``: the same code as on a GPU (caches laid out as vLLM allocates them, the
worker's copies on thread streams, a real tier), so it does not rot while no GPU runs it.
A smoke test, not a speed test: no time is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_cpu_run_moves_every_byte_and_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "gpu", "--device", "cpu", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())

    assert report["all_bytes_equal"] is True
    assert {c["content"] for c in report["configs"]} == {"kv", "mla"}
    for config in report["configs"]:
        tier = config["tier"]
        assert tier["bytes_equal"] and tier["other_blocks_untouched"] and tier["failed_blocks"] == 0
        assert config["save_order"] != config["load_order"]
        assert set(config["overlap"]["added_ms"]) == {"layerwise", "whole-step", "engine-stream"}
        assert config["copies"]["worker_h2d_gbps"] > 0 and config["copies"]["worker_d2h_gbps"] > 0
