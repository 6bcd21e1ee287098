"""The objects the operator creates, as plain dicts: pure functions of a typed spec.

A CacheTier ``t`` owns: ConfigMap ``t-settings`` (the server's ``KVTIER_*``
settings), StatefulSet ``t`` (``kvtier server``, one PVC per replica for the
disk tier), headless Service ``t-headless`` (the StatefulSet's pod DNS) and
client Service ``t`` (what engines connect to).

A ModelRecipe ``m`` owns: ConfigMap ``m-kvtier`` (the kv-transfer-config and,
with the encoder cache, the ec-transfer-config), Deployment ``m`` (vLLM with
the kvtier connector), Service ``m``, and with an inline tier the CacheTier
``m-tier``.

Every child has the parent as its controlling owner (deleting the parent
garbage-collects it) and the labels of ``labels()``.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.operator.quantity import format_mebibytes
from kvtier.operator.spec import (
    API_VERSION,
    GPU_RESOURCE,
    CacheTier,
    ModelRecipe,
    Owner,
    Resources,
    SecretKeyRef,
)

Obj = dict[str, Any]

TIER_PORT = 50051
METRICS_PORT = 9400
ENGINE_PORT = 8000
DISK_DIR = "/var/lib/kvtier"
AUTH_DIR = "/etc/kvtier/auth"
AUTH_FILE = f"{AUTH_DIR}/token"
TIER_MEMORY_OVERHEAD = 512 * 2**20  # on top of the RAM tier: the process, buffers, gRPC
DISK_USABLE_FRACTION = 0.9  # leave room for the filesystem on the volume
SETTINGS_HASH_ANNOTATION = "kvtier.io/settings-hash"
KV_TRANSFER_KEY = "kv-transfer-config.json"
EC_TRANSFER_KEY = "ec-transfer-config.json"
MANAGED_BY = "kvtier-operator"


@dataclass(frozen=True)
class ClusterFeatures:
    """What the API server supports, where the operator's output depends on it."""

    grpc_probes: bool = True  # Probe.grpc: Kubernetes >= 1.24


def tier_endpoint(tier_name: str, namespace: str) -> str:
    """host:port of a CacheTier's client Service, as engines see it."""
    return f"{tier_name}.{namespace}.svc:{TIER_PORT}"


def engine_endpoint(recipe_name: str, namespace: str) -> str:
    return f"{recipe_name}.{namespace}.svc:{ENGINE_PORT}"


def labels(owner: Owner, component: str) -> dict[str, str]:
    """Labels of every child; the first three select the pods."""
    return {
        **selector(owner, component),
        "app.kubernetes.io/managed-by": MANAGED_BY,
        f"kvtier.io/{owner.kind.lower()}": owner.name,
    }


def selector(owner: Owner, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvtier",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": component,
    }


def owner_reference(owner: Owner) -> Obj:
    return {
        "apiVersion": API_VERSION,
        "kind": owner.kind,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def cache_tier_children(
    tier: CacheTier, default_image: str, features: ClusterFeatures
) -> list[Obj]:
    """The desired ConfigMap, StatefulSet and Services of a CacheTier."""
    owner, spec = tier.owner, tier.spec
    settings = tier_settings(tier)
    pod_labels = labels(owner, "cache-tier")
    annotations = {SETTINGS_HASH_ANNOTATION: _digest(settings)}
    if spec.metrics:
        annotations |= {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(METRICS_PORT),
            "prometheus.io/path": "/metrics",
        }
    ports = [{"name": "grpc", "containerPort": TIER_PORT, "protocol": "TCP"}]
    if spec.metrics:
        ports.append({"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"})
    env: list[Obj] = []
    if spec.redis is not None and spec.redis.password is not None:
        env.append(_secret_env("KVTIER_REDIS_PASSWORD", spec.redis.password))
    mounts: list[Obj] = []
    volumes: list[Obj] = []
    if spec.disk.enabled:
        mounts.append({"name": "data", "mountPath": DISK_DIR})
    if spec.auth is not None:
        mounts.append({"name": "auth", "mountPath": AUTH_DIR, "readOnly": True})
        volumes.append(_auth_volume(spec.auth))
    container: Obj = {
        "name": "kvtier-server",
        "image": spec.image or default_image,
        "command": ["kvtier", "server"],
        "envFrom": [{"configMapRef": {"name": f"{owner.name}-settings"}}],
        "ports": ports,
        "readinessProbe": _tier_probe(features, period=5, failures=3),
        "livenessProbe": _tier_probe(features, period=10, failures=6),
        "resources": _tier_resources(spec.resources, spec.ram_bytes),
        "securityContext": _container_security(),
    }
    if env:
        container["env"] = env
    if mounts:
        container["volumeMounts"] = mounts
    pod_spec: Obj = {"enableServiceLinks": False, "containers": [container]}
    if volumes:
        pod_spec["volumes"] = volumes
    statefulset_spec: Obj = {
        "serviceName": f"{owner.name}-headless",
        "replicas": spec.replicas,
        "podManagementPolicy": "Parallel",  # replicas are independent caches
        "selector": {"matchLabels": selector(owner, "cache-tier")},
        "template": {
            "metadata": {"labels": pod_labels, "annotations": annotations},
            "spec": pod_spec,
        },
    }
    if spec.disk.enabled:
        pvc_spec: Obj = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": spec.disk.size}},
        }
        if spec.disk.storage_class is not None:
            pvc_spec["storageClassName"] = spec.disk.storage_class
        statefulset_spec["volumeClaimTemplates"] = [
            {"metadata": {"name": "data", "labels": pod_labels}, "spec": pvc_spec}
        ]
    service_ports: list[Obj] = [
        {"name": "grpc", "port": TIER_PORT, "targetPort": "grpc", "protocol": "TCP"}
    ]
    if spec.metrics:
        service_ports.append(
            {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}
        )
    return [
        _object("v1", "ConfigMap", f"{owner.name}-settings", owner, "cache-tier", data=settings),
        _object("apps/v1", "StatefulSet", owner.name, owner, "cache-tier", spec=statefulset_spec),
        _object(
            "v1", "Service", f"{owner.name}-headless", owner, "cache-tier",
            spec={
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": selector(owner, "cache-tier"),
                "ports": service_ports[:1],
            },
        ),
        _object(
            "v1", "Service", owner.name, owner, "cache-tier",
            spec={
                "type": "ClusterIP",
                "selector": selector(owner, "cache-tier"),
                "ports": service_ports,
            },
        ),
    ]  # fmt: skip


def tier_settings(tier: CacheTier) -> dict[str, str]:
    """The ``kvtier server`` settings, as the env vars it reads (``KVTIER_<FLAG>``)."""
    spec = tier.spec
    settings = {
        "KVTIER_HOST": "0.0.0.0",
        "KVTIER_PORT": str(TIER_PORT),
        "KVTIER_METRICS_PORT": str(METRICS_PORT if spec.metrics else 0),
        "KVTIER_RAM_BYTES": str(spec.ram_bytes),
    }
    if spec.disk.enabled:
        settings["KVTIER_DISK_DIR"] = DISK_DIR
        settings["KVTIER_DISK_BYTES"] = str(int(spec.disk.size_bytes * DISK_USABLE_FRACTION))
    if spec.redis is not None:
        settings["KVTIER_REDIS_URL"] = spec.redis.url
        settings["KVTIER_REDIS_CLUSTER"] = "true" if spec.redis.cluster else "false"
    if spec.auth is not None:
        settings["KVTIER_AUTH_TOKEN_FILE"] = AUTH_FILE
    return settings


def model_recipe_children(recipe: ModelRecipe, tier_auth: SecretKeyRef | None) -> list[Obj]:
    """The desired ConfigMap, Deployment and Service (and inline CacheTier) of a ModelRecipe.

    ``tier_auth`` is the tier's auth Secret key, mounted into the engines too.
    """
    owner = recipe.owner
    config = {KV_TRANSFER_KEY: json.dumps(kv_transfer_config(recipe, tier_auth), sort_keys=True)}
    if recipe.cache.encoder_cache:
        config[EC_TRANSFER_KEY] = json.dumps(ec_transfer_config(recipe, tier_auth), sort_keys=True)
    config_name = f"{owner.name}-kvtier"
    env = [_config_env("KVTIER_KV_TRANSFER_CONFIG", config_name, KV_TRANSFER_KEY)]
    args = [
        "--model", recipe.model.repo,
        "--revision", recipe.model.revision,
        "--port", str(ENGINE_PORT),
        "--kv-transfer-config", "$(KVTIER_KV_TRANSFER_CONFIG)",
    ]  # fmt: skip
    if recipe.cache.encoder_cache:
        env.append(_config_env("KVTIER_EC_TRANSFER_CONFIG", config_name, EC_TRANSFER_KEY))
        args += ["--ec-transfer-config", "$(KVTIER_EC_TRANSFER_CONFIG)"]
    args += recipe.engine.args
    mounts: list[Obj] = [{"name": "shm", "mountPath": "/dev/shm"}]
    volumes: list[Obj] = [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
    if tier_auth is not None:
        mounts.append({"name": "kvtier-auth", "mountPath": AUTH_DIR, "readOnly": True})
        volumes.append({**_auth_volume(tier_auth), "name": "kvtier-auth"})
    health = {"httpGet": {"path": "/health", "port": "http"}}
    container: Obj = {
        "name": "vllm",
        "image": recipe.engine.image,
        "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
        "args": args,
        "env": env,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        # Loading weights can take many minutes: the startup probe allows 30.
        "startupProbe": {**health, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 6},
        "resources": _engine_resources(recipe.engine.resources, recipe.engine.gpus),
        "volumeMounts": mounts,
    }
    pod_labels = labels(owner, "engine")
    deployment_spec: Obj = {
        "replicas": recipe.engine.replicas,
        "selector": {"matchLabels": selector(owner, "engine")},
        "template": {
            "metadata": {
                "labels": pod_labels,
                "annotations": {SETTINGS_HASH_ANNOTATION: _digest(config)},
            },
            "spec": {"enableServiceLinks": False, "containers": [container], "volumes": volumes},
        },
    }
    children = [
        _object("v1", "ConfigMap", config_name, owner, "engine", data=config),
        _object("apps/v1", "Deployment", owner.name, owner, "engine", spec=deployment_spec),
        _object(
            "v1", "Service", owner.name, owner, "engine",
            spec={
                "type": "ClusterIP",
                "selector": selector(owner, "engine"),
                "ports": [
                    {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}
                ],
            },
        ),
    ]  # fmt: skip
    if recipe.inline_tier is not None:
        children.insert(0, inline_cache_tier(recipe))
    return children


def inline_cache_tier(recipe: ModelRecipe) -> Obj:
    """The dedicated CacheTier of a recipe with spec.tier.inline."""
    assert recipe.inline_tier is not None
    return _object(
        API_VERSION, "CacheTier", recipe.tier_name, recipe.owner, "cache-tier",
        spec=copy.deepcopy(dict(recipe.inline_tier)),
    )  # fmt: skip


def kv_transfer_config(recipe: ModelRecipe, tier_auth: SecretKeyRef | None) -> Obj:
    """vLLM's --kv-transfer-config for the kvtier connector."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": _connector_extra(recipe, tier_auth),
    }


def ec_transfer_config(recipe: ModelRecipe, tier_auth: SecretKeyRef | None) -> Obj:
    """vLLM's --ec-transfer-config for the kvtier encoder-cache connector."""
    return {
        "ec_connector": "KvtierECConnector",
        "ec_connector_module_path": "kvtier.connector.ec",
        "ec_role": "ec_both",
        "ec_connector_extra_config": _connector_extra(recipe, tier_auth),
    }


def _connector_extra(recipe: ModelRecipe, tier_auth: SecretKeyRef | None) -> Obj:
    extra: Obj = {
        "target": tier_endpoint(recipe.tier_name, recipe.owner.namespace),
        "chunk_size": recipe.cache.chunk_size,
        "codec": recipe.cache.codec,
        "salt_policy": recipe.cache.salt_policy,
    }
    if recipe.cache.salt_policy == "namespace":
        extra["salt"] = recipe.owner.namespace
    if tier_auth is not None:
        extra["auth_token_file"] = AUTH_FILE
    return extra


def _object(
    api_version: str, kind: str, name: str, owner: Owner, component: str, **body: Any
) -> Obj:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": owner.namespace,
            "labels": labels(owner, component),
            "ownerReferences": [owner_reference(owner)],
        },
        **body,
    }


def _tier_probe(features: ClusterFeatures, *, period: int, failures: int) -> Obj:
    # grpc.health.v1 on the gRPC port; a TCP check where the API server predates gRPC probes.
    check: Obj = (
        {"grpc": {"port": TIER_PORT}}
        if features.grpc_probes
        else {"tcpSocket": {"port": TIER_PORT}}
    )
    return {**check, "periodSeconds": period, "failureThreshold": failures}


def _tier_resources(resources: Resources | None, ram_bytes: int) -> Obj:
    if resources is not None:
        return _resources_dict(resources.requests, resources.limits)
    memory = format_mebibytes(ram_bytes + TIER_MEMORY_OVERHEAD)
    return {"requests": {"memory": memory}, "limits": {"memory": memory}}


def _engine_resources(resources: Resources | None, gpus: int) -> Obj:
    requests = dict(resources.requests) if resources is not None else {}
    limits = dict(resources.limits) if resources is not None else {}
    if gpus:
        limits[GPU_RESOURCE] = gpus
    return _resources_dict(requests, limits)


def _resources_dict(requests: Mapping[str, int | str], limits: Mapping[str, int | str]) -> Obj:
    out: Obj = {}
    if requests:
        out["requests"] = {name: str(value) for name, value in requests.items()}
    if limits:
        out["limits"] = {name: str(value) for name, value in limits.items()}
    return out


def _container_security() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _auth_volume(ref: SecretKeyRef) -> Obj:
    return {
        "name": "auth",
        "secret": {"secretName": ref.name, "items": [{"key": ref.key, "path": "token"}]},
    }


def _secret_env(name: str, ref: SecretKeyRef) -> Obj:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def _config_env(name: str, config_map: str, key: str) -> Obj:
    return {"name": name, "valueFrom": {"configMapKeyRef": {"name": config_map, "key": key}}}


def _digest(data: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
