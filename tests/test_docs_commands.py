"""The benchmark commands the docs quote exist: every ``kvtier bench NAME`` is a
harness of ``kvtier bench`` and every ``python -m kvtier.bench.NAME`` a module, so a
figure's command cannot silently name something that is gone (issue 21: every number
in the docs has the committed command that produced it)."""

from __future__ import annotations

import re
from pathlib import Path

from kvtier.bench.cli import HARNESSES

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "README.md",
    ROOT / "helm" / "kvtier" / "README.md",
    *sorted((ROOT / "recipes").glob("*.rst")),
]


def quoted(pattern: str) -> set[tuple[str, str]]:
    return {
        (path.relative_to(ROOT).as_posix(), name)
        for path in DOCS
        for name in re.findall(pattern, path.read_text())
    }


def test_every_kvtier_bench_harness_the_docs_name_exists() -> None:
    named = quoted(r"kvtier bench ([a-z0-9_]+)")
    assert named, "the docs name no kvtier bench harness: the pattern is wrong"
    assert {(doc, name) for doc, name in named if name not in HARNESSES} == set()


def test_every_kvtier_bench_module_the_docs_run_exists() -> None:
    named = quoted(r"-m kvtier\.bench\.([a-z_]+)")
    assert named
    missing = {
        (doc, name) for doc, name in named if not (ROOT / "kvtier" / "bench" / f"{name}.py").exists()
    }
    assert missing == set()
