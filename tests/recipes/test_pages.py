"""recipes/ agrees with itself and with the tests: the index table, the pages, the
ModelRecipe YAMLs (validated against the CRD in operator/kvtier/operator/crds) and
tests/recipes/architectures.py (what test_architectures.py runs). The pages build
with Sphinx, warnings as errors."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.recipes.architectures import ARCHITECTURES, BY_PAGE

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
CRDS = ROOT / "operator" / "kvtier" / "operator" / "crds"
NOT_RECIPES = {"index", "contributing"}
ENGINES = ("vLLM", "SGLang", "TRT-LLM")
CHECK, DASH = "✓", "—"
ARCHITECTURE_TESTS = "tests/recipes/test_architectures.py"


def table_rows(text: str | None = None) -> list[dict[str, str]]:
    """The rows of the (first) list-table in ``text`` (default: recipes/index.rst), keyed
    by the header cells."""
    text = (RECIPES / "index.rst").read_text() if text is None else text
    block = text.split(".. list-table::", 1)[1]
    rows: list[list[str]] = []
    for line in block.splitlines()[1:]:
        if line.strip() and not line.startswith("   "):
            break  # the end of the indented directive
        cell = re.match(r"^   (\*| ) - (.*)$", line)
        if cell is None:
            continue
        if cell.group(1) == "*":
            rows.append([])
        rows[-1].append(cell.group(2).strip())
    header, *body = rows
    return [dict(zip(header, row, strict=True)) for row in body]


def page_of(row: dict[str, str]) -> str:
    match = re.fullmatch(r":doc:`(\w+)`", row["Recipe"])
    assert match, f"the Recipe cell must be a :doc: link, got {row['Recipe']!r}"
    return match.group(1)


def recipe_pages() -> set[str]:
    return {p.stem for p in RECIPES.glob("*.rst")} - NOT_RECIPES


def modelrecipe_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the ModelRecipe CRD, whatever file in operator/kvtier/operator/crds holds it."""
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd.get("kind") == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == (
            "ModelRecipe"
        ):
            (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
            schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
            return schema
    raise AssertionError(f"no ModelRecipe CRD in {CRDS}")


def test_pages_build_with_sphinx_warnings_as_errors(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(RECIPES), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for page in recipe_pages() | NOT_RECIPES:
        assert (tmp_path / "html" / f"{page}.html").exists()


def test_every_table_row_has_a_page_and_a_yaml() -> None:
    for row in table_rows():
        page = page_of(row)
        assert (RECIPES / f"{page}.rst").exists(), f"row {row['Model family']}: no page"
        assert (RECIPES / f"{page}.yaml").exists(), f"row {row['Model family']}: no YAML"


def test_every_page_and_yaml_has_a_table_row() -> None:
    rows = {page_of(row) for row in table_rows()}
    assert recipe_pages() == rows
    assert {p.stem for p in RECIPES.glob("*.yaml")} == rows


def test_every_row_is_a_tested_architecture_with_its_class() -> None:
    rows = {page_of(row): row for row in table_rows()}
    assert set(rows) == set(BY_PAGE), "a row without a test, or a test without a row"
    for page, row in rows.items():
        assert row["Architecture class"] == f"``{BY_PAGE[page].vllm_class}``"


def test_a_vllm_check_mark_only_where_the_architecture_test_runs() -> None:
    for row in table_rows():
        assert row["vLLM"] in (CHECK, DASH)
        assert (row["vLLM"] == CHECK) == (page_of(row) in BY_PAGE)


def test_no_check_mark_for_engines_without_tests() -> None:
    # tests/recipes runs vLLM only: SGLang and TRT-LLM cannot be ✓.
    for row in table_rows():
        assert row["SGLang"] == DASH and row["TRT-LLM"] == DASH, row["Model family"]


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.page)
def test_yaml_validates_against_the_modelrecipe_crd(arch: Any) -> None:
    (document,) = yaml.safe_load_all((RECIPES / f"{arch.page}.yaml").read_text())
    jsonschema.validate(document, modelrecipe_schema(), cls=jsonschema.Draft4Validator)


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.page)
def test_yaml_deploys_the_tested_class_with_its_modality(arch: Any) -> None:
    (document,) = yaml.safe_load_all((RECIPES / f"{arch.page}.yaml").read_text())
    model = document["spec"]["model"]
    assert model["architecture"] == arch.hf_architecture
    assert arch.modality in model["modalities"]
    assert document["spec"]["engine"]["kind"] == "vllm"


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.page)
def test_page_has_every_section_and_says_what_was_run(arch: Any) -> None:
    text = (RECIPES / f"{arch.page}.rst").read_text()
    for title in ("Validated models", "Engines", "CacheBlend", "Compression", "Caveats"):
        assert re.search(rf"^{re.escape(title)}\n-+$", text, re.M), f"no {title} section"
    assert f"``{arch.vllm_class}``" in text
    assert f".. literalinclude:: {arch.page}.yaml" in text
    assert f"kubectl -n <namespace> apply -f recipes/{arch.page}.yaml" in text
    assert "Real checkpoints run: none." in text


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.page)
def test_engines_section_has_one_tab_per_engine_and_only_vllm_is_validated(arch: Any) -> None:
    engines = section((RECIPES / f"{arch.page}.rst").read_text(), "Engines")
    assert engines.lstrip().startswith(".. tab-set::")
    tabs = re.split(r"^   \.\. tab-item:: (.+)\n", engines, flags=re.M)[1:]
    bodies = dict(zip(tabs[::2], (body.strip() for body in tabs[1::2]), strict=True))
    assert list(bodies) == list(ENGINES)
    assert "kvtier server" in bodies["vLLM"] and "--kv-transfer-config" in bodies["vLLM"]
    assert bodies["SGLang"] == bodies["TRT-LLM"] == "Not validated."


def cited_tests(text: str) -> list[tuple[str, str]]:
    """The ``tests/<file>.py::<function>`` references in a page."""
    return re.findall(r"``(tests/[\w/]+\.py)::(\w+)``", text)


def per_architecture_tests() -> set[str]:
    """The functions of test_architectures.py that take the ``engines`` fixture, which
    runs them once per entry of ARCHITECTURES."""
    tree = ast.parse((ROOT / ARCHITECTURE_TESTS).read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and "engines" in [a.arg for a in node.args.args]
    }


def test_every_test_a_page_cites_exists() -> None:
    for page in sorted(recipe_pages() | NOT_RECIPES):
        for path, name in cited_tests((RECIPES / f"{page}.rst").read_text()):
            source = ROOT / path
            assert source.exists(), f"{page}: no {path}"
            assert re.search(rf"^def {name}\(", source.read_text(), re.M), (
                f"{page}: no {path}::{name}"
            )


def section(text: str, title: str) -> str:
    """The body of the page's section ``title``, up to the next section's title."""
    body = text.split(f"{title}\n{'-' * len(title)}\n", 1)[1]
    return re.split(r"^[^\n]+\n-{3,}$", body, maxsplit=1, flags=re.M)[0]


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.page)
def test_validated_codecs_and_encoder_cache_cite_a_test_that_runs_every_architecture(
    arch: Any,
) -> None:
    """A ✓ in the compression table or on the encoder-output cache names the test behind
    it, and that test runs once per architecture (it takes the ``engines`` fixture)."""
    text = (RECIPES / f"{arch.page}.rst").read_text()
    rows = section(text, "Compression").split("   * - ")[2:]  # after the header row
    validated = [row for row in rows if "✓ validated" in row]
    assert [row.split("\n")[0] for row in validated] == [
        "uncompressed (``codec: raw``, default)",
        "zstd (``codec: zstd``, level 1)",
    ]
    zstd_tests = {name for path, name in cited_tests(validated[1]) if path == ARCHITECTURE_TESTS}
    assert zstd_tests and zstd_tests <= per_architecture_tests()
    (encoder_cache,) = [
        line for line in section(text, "Caveats").split("\n- ") if "Encoder-output cache" in line
    ]
    assert encoder_cache.lstrip("- ").startswith("Encoder-output cache: ✓ validated")
    ec_tests = {name for path, name in cited_tests(encoder_cache) if path == ARCHITECTURE_TESTS}
    assert len(ec_tests) == 2 and ec_tests <= per_architecture_tests()


HYBRID_TESTS = "tests/recipes/test_hybrid.py"


def hybrid_rows() -> list[dict[str, str]]:
    """The rows of the list-table in the index's *Hybrid Attention Models* section."""
    return table_rows(section((RECIPES / "index.rst").read_text(), "Hybrid Attention Models"))


def test_the_hybrid_section_lists_exactly_the_sliding_window_architectures() -> None:
    rows = {page_of(row): row for row in hybrid_rows()}
    assert next(iter(rows)) == "gemma3"
    assert set(rows) == {arch.page for arch in ARCHITECTURES if arch.sliding_window}
    for page, row in rows.items():
        assert row["Architecture class"] == f"``{BY_PAGE[page].vllm_class}``"
        assert row["Manager on with kvtier"] == CHECK


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a.sliding_window], ids=lambda a: a.page)
def test_a_hybrid_page_says_what_each_group_stores_and_cites_the_hybrid_tests(arch: Any) -> None:
    text = section((RECIPES / f"{arch.page}.rst").read_text(), "Hybrid attention")
    assert "full-attention" in text and "sliding-window" in text
    cited = {name for path, name in cited_tests(text) if path == HYBRID_TESTS}
    tree = ast.parse((ROOT / HYBRID_TESTS).read_text())
    every = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert cited == {name for name in every if name.startswith("test_")}
