"""The encoder-cache harness (kvtier/bench/ec.py) runs end to end in its --tiny mode.

A smoke test, not a speed test: three engines run the workload, the cached engine
loads every picture from the tier without running its encoder, the first tokens
match the baseline's, and the results land in a well-formed table. No speed is
asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    work = tmp_path_factory.mktemp("bench-ec")
    out = work / "ec.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "ec", "--tiny", "--work", str(work), "--json", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_the_cached_engine_loads_every_picture_and_never_runs_its_encoder(
    tiny_run: tuple[dict[str, Any], str],
) -> None:
    result, _ = tiny_run
    runs = {r["engine"]: r for r in result["runs"]}
    pictures = result["args"]["pool"]
    assert runs["baseline"]["encoder_calls"] > 0 and runs["baseline"]["ec_hits"] == 0
    assert runs["cached"]["encoder_calls"] == 0
    assert runs["cached"]["ec_hits"] == pictures


def test_the_cached_engine_gives_the_baselines_first_tokens(
    tiny_run: tuple[dict[str, Any], str],
) -> None:
    assert tiny_run[0]["same_tokens"] is True


def test_the_results_table_has_a_row_per_engine(tiny_run: tuple[dict[str, Any], str]) -> None:
    rows = [line for line in tiny_run[1].splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["writer", "baseline", "cached"]
