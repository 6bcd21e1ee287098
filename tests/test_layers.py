"""The import layers of DESIGN.md are import-linter contracts (``.importlinter``), run by
scripts/test on the real tree; these tests show the contracts hold and can fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("proto", "cacheserver", "connector", "operator")


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over ``tree`` (a checkout), its distribution folders on the path."""
    path = os.pathsep.join([*(str(tree / part) for part in PARTS), str(tree)])
    return subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--config", str(tree / ".importlinter")],
        cwd=tree, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    """The checkout's Python sources and contracts, copied."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build")
    for name in (*PARTS, "kvtier", "tests"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=ignore)
    shutil.copy(ROOT / ".importlinter", tmp_path)
    return tmp_path


def test_the_source_tree_keeps_every_contract() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("where", "line", "contract"),
    [
        ("proto/kvtier/proto/_probe.py", "from kvtier.cacheserver import store", "proto imports nothing of kvtier"),
        ("cacheserver/kvtier/cacheserver/_probe.py", "import kvtier.connector.chunks.keys",
         "the server, the connector and the operator never import each other"),
        ("connector/kvtier/connector/_probe.py", "import vllm",
         "keys and the chunk codec import neither the tier client, vLLM nor torch"),
        ("operator/kvtier/operator/_probe.py", "import grpc", "the operator imports no server or connector runtime"),
        ("connector/kvtier/connector/client/_probe.py", "import torch",
         "the tier client imports neither vLLM nor torch"),
        ("connector/kvtier/connector/_probe.py", "from kvtier.testing import tierproc",
         "nothing shipped imports the tests, the benchmarks or the testing package"),
    ],
)  # fmt: skip
def test_a_planted_forbidden_import_breaks_its_contract(
    tree_copy: Path, where: str, line: str, contract: str
) -> None:
    probe = tree_copy / where
    probe.write_text(line + "\n")
    if "kvtier/connector/" in where and "vllm" in line:
        # reached from chunks/keys.py, so the engine-free contract sees it indirectly
        keys = tree_copy / "connector/kvtier/connector/chunks/keys.py"
        keys.write_text(keys.read_text() + "\nfrom kvtier.connector import _probe  # noqa\n")
    result = lint_imports(tree_copy)
    assert result.returncode != 0
    assert f"{contract} BROKEN" in result.stdout, result.stdout[-4000:]
