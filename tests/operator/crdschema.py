"""The CRDs' OpenAPI schemas used as the API server uses them: validation and defaulting."""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "operator" / "kvtier" / "operator" / "crds"
CRD_FILES = {"CacheTier": "kvtier.io_cachetiers.yaml", "ModelRecipe": "kvtier.io_modelrecipes.yaml"}


@cache
def crd(kind: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CRD_DIR / CRD_FILES[kind]).read_text())
    return loaded


def schema(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of the kind's only version."""
    (version,) = crd(kind)["spec"]["versions"]
    return copy.deepcopy(version["schema"]["openAPIV3Schema"])


def validate(obj: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError where the API server would reject ``obj``."""
    jsonschema.validate(obj, schema(obj["kind"]), cls=jsonschema.Draft4Validator)


def with_defaults(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with the schema's defaults applied, as the API server stores it."""
    out = copy.deepcopy(obj)
    _default(out, schema(obj["kind"]))
    return out


def _default(value: Any, node: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for name, prop in node.get("properties", {}).items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                _default(value[name], prop)
    elif isinstance(value, list) and "items" in node:
        for item in value:
            _default(item, node["items"])
