"""Custom-resource bodies for tests, as the API server would hand them to the operator."""

from __future__ import annotations

import copy
from typing import Any

from tests.operator.crdschema import with_defaults


def cache_tier(name: str = "shared", namespace: str = "ml", **spec: Any) -> dict[str, Any]:
    return with_defaults(
        {
            "apiVersion": "kvtier.io/v1alpha1",
            "kind": "CacheTier",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": f"uid-{name}",
                "generation": 1,
            },
            "spec": copy.deepcopy(spec),
        }
    )


def model_recipe(name: str = "qwen", namespace: str = "ml", **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {
            "repo": "Qwen/Qwen2.5-VL-7B-Instruct",
            "architecture": "Qwen2_5_VLForConditionalGeneration",
            "modalities": ["text", "image"],
        },
        "engine": {"image": "vllm/vllm-openai:v0.11.0"},
        "tier": {"ref": {"name": "shared"}},
    }
    for key, value in overrides.items():
        spec[key] = copy.deepcopy(value)
    return with_defaults(
        {
            "apiVersion": "kvtier.io/v1alpha1",
            "kind": "ModelRecipe",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": f"uid-{name}",
                "generation": 1,
            },
            "spec": spec,
        }
    )
