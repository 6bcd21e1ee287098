"""The end-to-end harness (kvtier/bench/e2e.py) runs through ``kvtier bench e2e --tiny``.

A smoke test, not a speed test: real vLLM engines (tiny text and vision models)
run every workload in every arm, one engine at a time, and the run lands in a
well-formed result. No time is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARMS = ["no-cache", "vllm-offload", "kvtier", "kvtier-local"]
KVTIER_ARMS = ("kvtier", "kvtier-local")  # the data port, the same-node transport
WORKLOADS = {"docqa", "chat", "mm"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, str]:
    tmp = tmp_path_factory.mktemp("bench-e2e")
    out = tmp / "e2e.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "e2e", "--tiny", "--arms", ",".join(ARMS),
         "--work", str(tmp / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout, proc.stderr


def test_every_arm_is_measured_or_reported_with_the_engines_error(
    tiny_run: tuple[dict[str, Any], str, str],
) -> None:
    data, stdout, _ = tiny_run
    measured = {r["arm"] for r in data["results"]}
    failed = {a["arm"]: a["error"] for a in data["arms"] if a["error"]}
    assert measured | set(failed) == set(ARMS)
    assert not measured & set(failed)
    assert {"no-cache", "kvtier", "kvtier-local"} <= measured
    for arm, error in failed.items():
        assert error and f"- {arm} (" in stdout and error in stdout


def test_each_measured_arm_ran_every_request_of_every_workload(
    tiny_run: tuple[dict[str, Any], str, str],
) -> None:
    data, _, _ = tiny_run
    base = [
        (r["workload"], r["kind"], r["label"]) for r in data["results"] if r["arm"] == "no-cache"
    ]
    assert {w for w, _, _ in base} == WORKLOADS
    assert len(set(base)) == len(base)
    for arm in {r["arm"] for r in data["results"]}:
        mine = [(r["workload"], r["kind"], r["label"]) for r in data["results"] if r["arm"] == arm]
        assert mine == base
    for r in data["results"]:
        assert r["ttft_s"] > 0 and r["prompt_tokens"] > 0


def test_no_cache_reuses_nothing_and_both_kvtier_arms_serve_every_repeat_from_the_tier(
    tiny_run: tuple[dict[str, Any], str, str],
) -> None:
    data, _, _ = tiny_run
    for r in data["results"]:
        if r["arm"] == "no-cache":
            assert r["cached_tokens"] == 0, r  # the in-engine prefix cache is off
        # Images too: vLLM's processor cache stays on, so images are named by content.
        if r["arm"] in KVTIER_ARMS and r["kind"] == "repeat":
            assert r["cached_tokens"] >= 256, r  # at least one chunk came from the tier
        if r["arm"] in KVTIER_ARMS and r["kind"] == "first" and r["workload"] == "docqa":
            assert r["cached_tokens"] == 0, r  # not even from the other kvtier arm's chunks
    for arm in KVTIER_ARMS:
        assert next(a for a in data["arms"] if a["arm"] == arm)["connector"]["loaded_chunks"] > 0


def test_both_kvtier_arms_give_the_same_first_tokens_as_no_cache(
    tiny_run: tuple[dict[str, Any], str, str],
) -> None:
    data, _, _ = tiny_run
    for row in data["summary"]:
        if row["arm"] in KVTIER_ARMS:
            assert row["same_first_token"] == row["requests"], row


def test_summary_has_ratios_goals_and_a_well_formed_table(
    tiny_run: tuple[dict[str, Any], str, str],
) -> None:
    data, stdout, _ = tiny_run
    rows = {(r["workload"], r["arm"]): r for r in data["summary"]}
    for workload in WORKLOADS:
        assert rows[(workload, "no-cache")]["repeat_ttft_vs_no_cache"] == pytest.approx(1.0)
        for arm in KVTIER_ARMS:
            assert rows[(workload, arm)]["repeat_ttft_vs_no_cache"] > 0
    assert [g["goal"] for g in data["goals"]] == [
        "docqa repeat TTFT <= 0.25x no-cache",
        "docqa first TTFT <= 1.05x no-cache",
    ]
    assert all(isinstance(g["met"], bool) for g in data["goals"])
    table = [line for line in stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(data["summary"])
    assert len({line.count("|") for line in table}) == 1
    assert set(table[1].replace("|", "").replace(":", "")) == {"-"}
