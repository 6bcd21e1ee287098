"""The README's run command, ``scripts/demo``, as a user runs it: its output checked."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_scripts_demo_loads_repeats_from_the_tier_over_the_data_port(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo"), "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    hits = [int(n) for n in re.findall(r"hit tokens from the tier: (\d+)", out)]
    (length,) = {int(n) for n in re.findall(r": (\d+) prompt tokens", out)}
    (image_at,) = re.findall(r"it starts at token (\d+)", out)
    assert hits == [0, length // 256 * 256, int(image_at) // 256 * 256]
    assert "[demo] request 2 output identical to request 1: True" in out
    gets, puts = map(int, re.search(r"answered (\d+) Get and (\d+) Put calls on its data port", out).groups())
    assert gets >= 2 and puts >= 1
    assert out.rstrip().endswith("[demo] OK: repeats load from the tier, another image misses from the image on")
