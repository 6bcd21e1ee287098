"""Each distribution declares what it imports: the images install one distribution and its
declared dependencies, nothing else, so an import that is only there because the dev venv
has everything breaks the image at its first start (kvtier-server imported xxhash without
declaring it: the tier pod crashed on `ModuleNotFoundError: No module named 'xxhash'`).

tests/cluster/test_user_story.py checks the same in the built images themselves."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("proto", "cacheserver", "connector", "operator")
# Imported but provided by the environment the distribution runs in, on purpose.
PROVIDED = {"connector": {"vllm", "torch"}}  # the engine image's vLLM (and its torch)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def third_party_imports(part: str) -> set[str]:
    """Top-level names of every non-stdlib, non-kvtier module the part's sources import."""
    found: set[str] = set()
    for path in (ROOT / part / "kvtier").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("kvtier", "__future__"):
                    found.add(top)
    return found


def declared(part: str) -> set[str]:
    with open(ROOT / part / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"].get("dependencies", [])
    return {_norm(re.split(r"[\s<>=!~;\[]", dep, maxsplit=1)[0]) for dep in deps}


@pytest.mark.parametrize("part", PARTS)
def test_every_import_of_a_distribution_is_a_declared_dependency(part: str) -> None:
    providers = importlib.metadata.packages_distributions()
    missing = []
    for module in sorted(third_party_imports(part) - PROVIDED.get(part, set())):
        dists = {_norm(d) for d in providers.get(module, [])}
        assert dists, f"{part} imports {module}, which no installed distribution provides"
        if not dists & declared(part):
            missing.append(f"{module} (from {', '.join(sorted(dists))})")
    assert not missing, f"{part}/pyproject.toml does not declare: {', '.join(missing)}"


def test_the_check_sees_an_undeclared_import() -> None:
    """Negative control: the server does import xxhash, and the check maps it to its distribution."""
    assert "xxhash" in third_party_imports("cacheserver")
    assert "xxhash" in importlib.metadata.packages_distributions()["xxhash"]
    assert "redis" in declared("cacheserver") and "xxhash" not in declared("operator")
