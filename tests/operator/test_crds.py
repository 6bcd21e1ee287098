from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvtier.operator.spec import parse_cache_tier, parse_model_recipe
from tests.operator import crdschema
from tests.operator.bodies import cache_tier

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml")) + sorted((ROOT / "recipes" / "local").glob("tiny-*.yaml"))
DOC = ROOT / "docs" / "operator.md"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_yaml_validates_against_the_modelrecipe_crd(path: Path) -> None:
    for document in yaml.safe_load_all(path.read_text()):
        crdschema.validate(document)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_yaml_parses_into_a_model_recipe(path: Path) -> None:
    for document in yaml.safe_load_all(path.read_text()):
        body = crdschema.with_defaults(document)
        body["metadata"] |= {"namespace": "default", "uid": "u", "generation": 1}
        parse_model_recipe(body)


def test_the_inline_tier_schema_is_the_cachetier_spec_schema() -> None:
    inline = crdschema.schema("ModelRecipe")["properties"]["spec"]["properties"]["tier"][
        "properties"
    ]["inline"]
    tier_spec = crdschema.schema("CacheTier")["properties"]["spec"]
    inline.pop("description")
    tier_spec.pop("description")
    assert inline == tier_spec


def test_the_parser_defaults_are_the_crd_defaults() -> None:
    body = cache_tier()  # CRD defaults applied
    assert parse_cache_tier(body) == parse_cache_tier({**body, "spec": {}})


def test_the_schema_rejects_an_unsupported_engine_kind() -> None:
    recipe = yaml.safe_load((ROOT / "recipes" / "qwen2_5_vl.yaml").read_text())
    recipe["spec"]["engine"]["kind"] = "sglang"
    with pytest.raises(jsonschema.ValidationError, match="'sglang' is not one of"):
        crdschema.validate(recipe)


def test_both_crds_have_a_status_subresource_with_a_schema() -> None:
    for kind in crdschema.CRD_FILES:
        (version,) = crdschema.crd(kind)["spec"]["versions"]
        assert version["subresources"] == {"status": {}}
        assert (
            "conditions"
            in version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
        )


def test_modelrecipes_print_model_tier_ready_and_age() -> None:
    (version,) = crdschema.crd("ModelRecipe")["spec"]["versions"]
    default_columns = [
        c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")
    ]
    assert default_columns == ["Model", "Tier", "Ready", "Age"]


def field_paths(node: dict[str, Any], prefix: str) -> list[str]:
    paths = []
    for name, child in node.get("properties", {}).items():
        path = f"{prefix}.{name}" if prefix else name
        paths.append(path)
        paths += field_paths(child, path)
    if "items" in node:
        paths += field_paths(node["items"], prefix)
    return paths


@pytest.mark.parametrize("kind", crdschema.CRD_FILES)
def test_every_crd_field_is_in_the_reference(kind: str) -> None:
    schema = crdschema.schema(kind)
    documented = set(re.findall(r"`([A-Za-z0-9_.\[\]]+)`", DOC.read_text()))
    for section in ("spec", "status"):
        for path in field_paths(schema["properties"][section], section):
            if path.startswith("spec.tier.inline."):
                continue  # documented once, as the CacheTier's spec
            assert path in documented, f"{kind} field {path} is missing from docs/operator.md"
