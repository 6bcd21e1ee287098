"""Where an engine's weights come from: the hub or a volume, a hub token, a shared cache.

A ModelRecipe's ``spec.model`` becomes part of the engine's pod template:

- hub (the default): ``--model <repo>``; vLLM downloads into ``HF_HOME``.
- ``volume``: the claim is mounted read-only at ``/models`` and vLLM gets
  ``--model /models/<path> --served-model-name <repo>`` (clients keep using the
  recipe's model name) with ``HF_HUB_OFFLINE=1`` (nothing is fetched). The
  connector's ``model_id`` is the repo too, so an engine reading the same model
  from a volume and one downloading it share cache entries.
- ``tokenSecretRef``: ``HF_TOKEN`` from that Secret key (gated models).
- ``cache``: a claim mounted at ``/var/cache/huggingface`` with ``HF_HOME`` there,
  shared by every replica, so a restarted or added replica does not download again:
  an existing claim (``claimName``) or one the operator creates once,
  ``<recipe>-model-cache`` (``size``, ``storageClassName``, ``accessMode``,
  ReadWriteMany by default, which lets replicas on several nodes mount it).

Pure functions of the typed spec; ``children.model_recipe_children`` puts them in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.operator.spec import Model, ModelCache, ModelRecipe

Obj = dict[str, Any]

MODEL_DIR = "/models"  # a spec.model.volume claim, read-only
MODEL_CACHE_DIR = "/var/cache/huggingface"  # HF_HOME on spec.model.cache
MODEL_CACHE_SUFFIX = "-model-cache"  # the claim the operator creates for spec.model.cache.size


@dataclass(frozen=True)
class EngineWeights:
    """What the engine container needs to find its weights."""

    model: str  # vLLM's --model: the repo, or a directory under MODEL_DIR
    args: tuple[str, ...] = ()  # after --model: --served-model-name for a volume
    env: tuple[Obj, ...] = ()
    volumes: tuple[Obj, ...] = ()
    mounts: tuple[Obj, ...] = ()
    model_id: str | None = None  # the connector's model_id, where --model is not the repo
    owned_claim: str | None = None  # the model cache claim the recipe owns
    shared_volumes: bool = field(default=False)  # PVCs: fsGroup changes only on mismatch


def engine_weights(recipe: ModelRecipe) -> EngineWeights:
    model = recipe.model
    env: list[Obj] = []
    volumes: list[Obj] = []
    mounts: list[Obj] = []
    if model.token is not None:
        env.append({
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": model.token.name, "key": model.token.key}},
        })  # fmt: skip
    owned = None
    if model.cache is not None:
        claim = model.cache.claim or model_cache_claim_name(recipe)
        owned = None if model.cache.claim else claim
        env.append({"name": "HF_HOME", "value": MODEL_CACHE_DIR})
        volumes.append({"name": "model-cache", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE_DIR})
    if model.volume is None:
        return EngineWeights(
            model=model.repo, env=tuple(env), volumes=tuple(volumes), mounts=tuple(mounts),
            owned_claim=owned, shared_volumes=bool(volumes),
        )  # fmt: skip
    env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    volumes.append({
        "name": "model",
        "persistentVolumeClaim": {"claimName": model.volume.claim, "readOnly": True},
    })  # fmt: skip
    mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    return EngineWeights(
        model=model_path(model),
        args=("--served-model-name", model.repo),
        env=tuple(env),
        volumes=tuple(volumes),
        mounts=tuple(mounts),
        model_id=model.repo,
        shared_volumes=True,
    )


def model_path(model: Model) -> str:
    """The directory vLLM loads a volume's model from."""
    assert model.volume is not None
    return f"{MODEL_DIR}/{model.volume.path}" if model.volume.path else MODEL_DIR


def model_cache_claim_name(recipe: ModelRecipe) -> str:
    return recipe.owner.name + MODEL_CACHE_SUFFIX


def model_cache_claim_spec(cache: ModelCache) -> Obj:
    """The spec of the model cache claim the operator creates (``spec.model.cache.size``)."""
    assert cache.size is not None
    spec: Obj = {
        "accessModes": [cache.access_mode],
        "resources": {"requests": {"storage": str(cache.size)}},
    }
    if cache.storage_class is not None:
        spec["storageClassName"] = cache.storage_class
    return spec
