"""The dependency directions of DESIGN.md, enforced on the source tree.

proto <- cacheserver; proto <- connector; the operator imports neither the
server nor the connector; the keys, the codec and the tier client import
neither vLLM nor torch (routers and tools reuse them), directly or through
another kvtier module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = {"cacheserver": "kvtier.cacheserver", "connector": "kvtier.connector",
              "operator": "kvtier.operator", "proto": "kvtier.proto", "kvtier": "kvtier"}  # fmt: skip


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [COMPONENTS[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    package = module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{alias.name}" for alias in node.names)
    return found


def sources(component: str) -> list[Path]:
    return [p for p in (ROOT / component).rglob("*.py") if "_pb2" not in p.name]


def _violations(component: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{p.relative_to(ROOT)} imports {name}"
        for p in sources(component)
        for name in imports_of(p)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    )


@pytest.mark.parametrize(
    ("component", "forbidden"),
    [
        ("cacheserver", ("kvtier.connector", "kvtier.operator")),
        ("connector", ("kvtier.cacheserver", "kvtier.operator")),
        ("operator", ("kvtier.cacheserver", "kvtier.connector")),
        ("proto", ("kvtier.cacheserver", "kvtier.connector", "kvtier.operator")),
    ],
)
def test_components_import_only_in_the_allowed_directions(component: str, forbidden: tuple[str, ...]) -> None:
    assert _violations(component, forbidden) == []


@pytest.mark.parametrize("module", ["keys", "codec", "client", "errors"])
def test_engine_free_connector_modules_never_reach_vllm_or_torch(module: str) -> None:
    seen: set[str] = set()
    todo = [ROOT / "connector" / f"{module}.py"]
    reached: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        for name in imports_of(path):
            reached.add(name)
            if name.startswith("kvtier.connector."):
                todo.append(ROOT / "connector" / (name.split(".")[2] + ".py"))
    bad = sorted(n for n in reached if n.split(".")[0] in ("vllm", "torch"))
    assert bad == [], f"connector/{module}.py reaches {bad}"


def test_the_layer_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    probe = ROOT / "proto" / "_layer_probe.py"
    probe.write_text("from kvtier.cacheserver import store\n")
    try:
        assert _violations("proto", ("kvtier.cacheserver",)) == [
            "proto/_layer_probe.py imports kvtier.cacheserver",
            "proto/_layer_probe.py imports kvtier.cacheserver.store",
        ]
    finally:
        probe.unlink()
