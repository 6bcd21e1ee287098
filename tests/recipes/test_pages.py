"""recipes/ agrees with itself and with the tests: the index table, the pages, the
ModelRecipe YAMLs (validated against the CRD in operator/crds) and
tests/recipes/architectures.py (what test_architectures.py runs). The pages build
with Sphinx, warnings as errors."""

from __future__ import annotations

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
CRDS = ROOT / "operator" / "crds"
NOT_RECIPES = {"index", "contributing"}
ENGINES = ("vLLM", "SGLang", "TRT-LLM")
CHECK, DASH = "✓", "—"


def table_rows() -> list[dict[str, str]]:
    """The rows of the list-table in recipes/index.rst, keyed by the header cells."""
    text = (RECIPES / "index.rst").read_text()
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
    """The openAPIV3Schema of the ModelRecipe CRD, whatever file in operator/crds holds it."""
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
    assert model["architecture"] == arch.vllm_class
    assert arch.modality in model["modalities"]
    assert document["spec"]["engine"]["kind"] == "vllm"


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.page)
def test_page_has_every_section_and_says_what_was_run(arch: Any) -> None:
    text = (RECIPES / f"{arch.page}.rst").read_text()
    for section in ("Validated models", *ENGINES, "CacheBlend", "Compression", "Caveats"):
        assert re.search(rf"^{re.escape(section)}\n-+$", text, re.M), f"no {section} section"
    assert f"``{arch.vllm_class}``" in text
    assert f".. literalinclude:: {arch.page}.yaml" in text
    assert f"kubectl -n <namespace> apply -f recipes/{arch.page}.yaml" in text
    assert "Real checkpoints run: none." in text
    assert "Encoder-output cache: not validated yet (issue #11)." in text
    for engine in ("SGLang", "TRT-LLM"):
        assert f"{engine}\n{'-' * len(engine)}\n\nNot validated." in text
