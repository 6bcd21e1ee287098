"""The objects the operator creates, as plain dicts: pure functions of a typed spec.

A CacheTier ``t`` owns: ConfigMap ``t-settings`` (the server's ``KVTIER_*``
settings), StatefulSet ``t`` (``kvtier server``, one PVC per replica for the
disk tier), headless Service ``t-headless`` (the StatefulSet's pod DNS) and
client Service ``t`` (what engines connect to).

A ModelRecipe ``m`` owns: ConfigMap ``m-kvtier`` (the kv-transfer-config and,
with the encoder cache, the ec-transfer-config), Deployment ``m`` (vLLM with
the kvtier connector; where its weights come from: ``kvtier.operator.weights``),
Service ``m``, with an inline tier the CacheTier ``m-tier``, and with
``spec.model.cache.size`` the PersistentVolumeClaim ``m-model-cache``.

A per-node CacheTier (``spec.topology: perNode``) has a DaemonSet instead of the
StatefulSet (``kvtier.operator.topology``).

Every child has the parent as its controlling owner (deleting the parent
garbage-collects it) and the labels of ``labels()``. Pods meet the Pod Security
"restricted" profile with read-only root filesystems, except those of a per-node
tier and its engines, which mount the node's socket directory (a hostPath).

Secrets are mounted key by key: an engine gets its tenant's token from the tier's
auth Secret, and only ``ca.crt`` from the tier's TLS Secret (never its private key).

Contracts (tests/operator/test_contracts.py runs them through the real parsers):
the tier's ConfigMap holds ``kvtier server`` flags as ``KVTIER_<FLAG>`` env vars;
the kv/ec-transfer configs' extra config is ``kvtier.connector.config.ConnectorConfig``.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.operator import topology
from kvtier.operator.quantity import format_mebibytes
from kvtier.operator.spec import (
    API_VERSION,
    GPU_RESOURCE,
    TLS_CA_KEY,
    TLS_CERT_KEY,
    TLS_KEY_KEY,
    CacheTier,
    ModelRecipe,
    Owner,
    Resources,
    SecretKeyRef,
    TierSpec,
)
from kvtier.operator.weights import EngineWeights, engine_weights, model_cache_claim_spec

Obj = dict[str, Any]

TIER_PORT = 50051
DATA_PORT = 50052  # kvtier server --data-port: raw-bytes Get/Put, advertised in Stats
METRICS_PORT = 9400
ENGINE_PORT = 8000
DISK_DIR = "/var/lib/kvtier"
TENANTS_DIR = "/etc/kvtier/tenants"  # the tier's auth Secret, one file per tenant
AUTH_DIR = "/etc/kvtier/auth"  # an engine's tenant token
AUTH_FILE = f"{AUTH_DIR}/token"
TLS_DIR = "/etc/kvtier/tls"  # the tier's TLS Secret (engines: only its ca.crt)
CLIENT_TLS_DIR = "/etc/kvtier/client-tls"  # an engine's client certificate (mutual TLS)
TMP_DIR = "/tmp"
TIER_UID = 65532  # the tier image's user (docker/Dockerfile.server)
ENGINE_UID = 1000  # any non-root uid: vLLM writes only to HOME, /tmp and /dev/shm
ENGINE_HOME = "/home/vllm"
TIER_MEMORY_OVERHEAD = 512 * 2**20  # on top of the RAM tier: the process, buffers, gRPC
DISK_USABLE_FRACTION = 0.9  # leave room for the filesystem on the volume
SETTINGS_HASH_ANNOTATION = "kvtier.io/settings-hash"
CERTIFICATES_HASH_ANNOTATION = "kvtier.io/certificates-hash"
KV_TRANSFER_KEY = "kv-transfer-config.json"
EC_TRANSFER_KEY = "ec-transfer-config.json"
MANAGED_BY = "kvtier-operator"
# spec.tenantQuotaBytes as the server's settings: the per-tenant quota flags, each set to the
# quota (the server's --tenant-quota-bytes bounds each tenant in the RAM and the disk tier).
# The one place to extend when the server gets a quota flag of its own for another tier.
TENANT_QUOTA_SETTINGS = ("KVTIER_TENANT_QUOTA_BYTES",)


@dataclass(frozen=True)
class Certificates:
    """The TLS files a pod mounts: (volume, Secret, keys, mount path) per Secret."""

    mounts: tuple[tuple[str, str, tuple[str, ...], str], ...] = ()

    def secrets(self) -> list[tuple[str, tuple[str, ...]]]:
        """(Secret, keys) pairs: what the operator hashes into ``kvtier.io/certificates-hash``."""
        return [(secret, keys) for _, secret, keys, _ in self.mounts]


def tier_certificates(spec: TierSpec) -> Certificates:
    """A tier's certificate and key (and, for mutual TLS, the CA that verifies clients)."""
    if spec.tls is None:
        return Certificates()
    keys = (TLS_CERT_KEY, TLS_KEY_KEY) + ((TLS_CA_KEY,) if spec.tls.client_auth else ())
    return Certificates((("tls", spec.tls.secret, keys, TLS_DIR),))


def engine_certificates(recipe: ModelRecipe, tier: TierSpec | None) -> Certificates:
    """What an engine needs to reach a TLS tier: only the tier Secret's ca.crt, and the
    recipe's client certificate if it names one."""
    if tier is None or tier.tls is None:
        return Certificates()
    mounts: list[tuple[str, str, tuple[str, ...], str]] = [
        ("kvtier-tls", tier.tls.secret, (TLS_CA_KEY,), TLS_DIR)
    ]
    if recipe.cache.client_cert_secret is not None:
        mounts.append((
            "kvtier-client-tls", recipe.cache.client_cert_secret, (TLS_CERT_KEY, TLS_KEY_KEY),
            CLIENT_TLS_DIR,
        ))  # fmt: skip
    return Certificates(tuple(mounts))


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
    tier: CacheTier,
    default_image: str,
    features: ClusterFeatures,
    certificates_hash: str | None = None,
) -> list[Obj]:
    """The desired ConfigMap, StatefulSet (a per-node tier: DaemonSet) and Services of a
    CacheTier.

    ``certificates_hash`` (of the TLS files the pods mount) goes into the pod template: the
    server reads its certificate at start, so a renewed one rolls the pods.
    """
    owner, spec = tier.owner, tier.spec
    settings = tier_settings(tier)
    pod_labels = labels(owner, "cache-tier")
    annotations = {SETTINGS_HASH_ANNOTATION: _digest(settings)}
    if certificates_hash is not None:
        annotations[CERTIFICATES_HASH_ANNOTATION] = certificates_hash
    if spec.metrics:
        annotations |= {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(METRICS_PORT),
            "prometheus.io/path": "/metrics",
        }
    ports = [{"name": "grpc", "containerPort": TIER_PORT, "protocol": "TCP"}]
    if spec.data_port:
        ports.append({"name": "data", "containerPort": DATA_PORT, "protocol": "TCP"})
    if spec.metrics:
        ports.append({"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"})
    env: list[Obj] = []
    if spec.redis is not None and spec.redis.password is not None:
        env.append(_secret_env("KVTIER_REDIS_PASSWORD", spec.redis.password))
    # The root filesystem is read-only: the server writes only to its disk volume and /tmp.
    mounts: list[Obj] = [{"name": "tmp", "mountPath": TMP_DIR}]
    volumes: list[Obj] = [{"name": "tmp", "emptyDir": {}}]
    if spec.disk.enabled:
        mounts.append({"name": "data", "mountPath": DISK_DIR})
    if spec.auth_secret is not None:
        # The whole Secret: one file per tenant, updated in place when the Secret changes.
        mounts.append({"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True})
        volumes.append({"name": "tenants", "secret": {"secretName": spec.auth_secret}})
    _mount_certificates(tier_certificates(spec), mounts, volumes)
    image = spec.image or default_image
    if spec.per_node:
        mounts.append(topology.socket_mount())
        volumes.append(topology.socket_volume(owner.namespace, owner.name))
        if spec.disk.enabled:
            volumes.append(topology.disk_volume(spec.disk.size))
    container: Obj = {
        "name": "kvtier-server",
        "image": image,
        "command": ["kvtier-server"],
        "envFrom": [{"configMapRef": {"name": f"{owner.name}-settings"}}],
        "ports": ports,
        "readinessProbe": _tier_probe(features, spec, period=5, failures=3),
        "livenessProbe": _tier_probe(features, spec, period=10, failures=6),
        "resources": _tier_resources(spec.resources, spec.ram_bytes),
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }
    if env:
        container["env"] = env
    pod_spec: Obj = {
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": pod_security(TIER_UID),
        "containers": [container],
        "volumes": volumes,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    template = {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod_spec}
    if spec.per_node:
        pod_spec["initContainers"] = [topology.prepare_socket_dir(image, TIER_UID)]
        workload = _object(
            "apps/v1", "DaemonSet", owner.name, owner, "cache-tier",
            spec=topology.daemonset_spec(selector(owner, "cache-tier"), template),
        )  # fmt: skip
    else:
        workload = _object(
            "apps/v1", "StatefulSet", owner.name, owner, "cache-tier",
            spec=_statefulset_spec(tier, template),
        )  # fmt: skip
    service_ports: list[Obj] = [
        {"name": port["name"], "port": port["containerPort"], "targetPort": port["name"],
         "protocol": "TCP"}
        for port in ports
    ]  # fmt: skip
    return [
        _object("v1", "ConfigMap", f"{owner.name}-settings", owner, "cache-tier", data=settings),
        workload,
        _object(
            "v1", "Service", f"{owner.name}-headless", owner, "cache-tier",
            spec={
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": selector(owner, "cache-tier"),
                "ports": [port for port in service_ports if port["name"] != "metrics"],
            },
        ),
        _object(
            "v1", "Service", owner.name, owner, "cache-tier",
            spec={
                "type": "ClusterIP",
                # Replicas are separate caches: every connection of one engine pod (gRPC and
                # data port, reconnects too) reaches the same replica.
                "sessionAffinity": "ClientIP",
                "selector": selector(owner, "cache-tier"),
                "ports": service_ports,
            },
        ),
    ]  # fmt: skip


def _statefulset_spec(tier: CacheTier, template: Obj) -> Obj:
    owner, spec = tier.owner, tier.spec
    statefulset_spec: Obj = {
        "serviceName": f"{owner.name}-headless",
        "replicas": spec.replicas,
        "podManagementPolicy": "Parallel",  # replicas are independent caches
        "selector": {"matchLabels": selector(owner, "cache-tier")},
        "template": template,
    }
    if spec.disk.enabled:
        pvc_spec: Obj = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": spec.disk.size}},
        }
        if spec.disk.storage_class is not None:
            pvc_spec["storageClassName"] = spec.disk.storage_class
        statefulset_spec["volumeClaimTemplates"] = [
            {"metadata": {"name": "data", "labels": labels(owner, "cache-tier")}, "spec": pvc_spec}
        ]
    return statefulset_spec


def tier_settings(tier: CacheTier) -> dict[str, str]:
    """The ``kvtier server`` settings, as the env vars it reads (``KVTIER_<FLAG>``)."""
    spec = tier.spec
    settings = {
        "KVTIER_HOST": "0.0.0.0",
        "KVTIER_PORT": str(TIER_PORT),
        "KVTIER_DATA_PORT": str(DATA_PORT if spec.data_port else 0),  # 0: off
        "KVTIER_METRICS_PORT": str(METRICS_PORT if spec.metrics else 0),  # 0: off
        "KVTIER_RAM_BYTES": str(spec.ram_bytes),
    }
    if spec.ram_recycle_bytes is not None:
        settings["KVTIER_RAM_RECYCLE_BYTES"] = str(spec.ram_recycle_bytes)
    if spec.tenant_quota_bytes:
        settings |= dict.fromkeys(TENANT_QUOTA_SETTINGS, str(spec.tenant_quota_bytes))
    if spec.per_node:
        settings["KVTIER_LOCAL_SOCKET"] = topology.LOCAL_SOCKET  # the same-node transport
    if spec.disk.enabled:
        settings["KVTIER_DISK_DIR"] = DISK_DIR
        settings["KVTIER_DISK_BYTES"] = str(int(spec.disk.size_bytes * DISK_USABLE_FRACTION))
    else:
        settings["KVTIER_DISK_BYTES"] = "0"  # 0: no disk tier (the server's default is on)
    if spec.redis is not None:
        settings["KVTIER_REDIS_URL"] = redis_url(spec.redis.url, cluster=spec.redis.cluster)
    if spec.auth_secret is not None:
        settings["KVTIER_AUTH_TOKENS"] = TENANTS_DIR
    if spec.tls is not None:
        settings["KVTIER_TLS_CERT_FILE"] = f"{TLS_DIR}/{TLS_CERT_KEY}"
        settings["KVTIER_TLS_KEY_FILE"] = f"{TLS_DIR}/{TLS_KEY_KEY}"
        if spec.tls.client_auth:
            settings["KVTIER_TLS_CLIENT_CA_FILE"] = f"{TLS_DIR}/{TLS_CA_KEY}"
    return settings


def redis_url(url: str, *, cluster: bool) -> str:
    """The server's Redis URL: a cluster is selected by the scheme (``redis+cluster://``)."""
    if not cluster:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}+cluster://{rest}"


def model_recipe_children(
    recipe: ModelRecipe, tier: TierSpec | None, certificates_hash: str | None = None
) -> list[Obj]:
    """The desired ConfigMap, Deployment and Service (and inline CacheTier) of a ModelRecipe.

    ``tier`` is the spec of the recipe's CacheTier (None while it does not exist). With its
    auth Secret, the Secret's key ``spec.cache.tenant`` is mounted into the engines as their
    token; with its TLS Secret, only that Secret's ``ca.crt``, and the recipe's client
    certificate (``spec.cache.clientCertSecretRef``). ``certificates_hash``: as for a tier
    (the connector reads its TLS files at start).
    """
    owner = recipe.owner
    weights = engine_weights(recipe)
    config = {KV_TRANSFER_KEY: json.dumps(kv_transfer_config(recipe, tier), sort_keys=True)}
    if recipe.cache.encoder_cache:
        config[EC_TRANSFER_KEY] = json.dumps(ec_transfer_config(recipe, tier), sort_keys=True)
    config_name = f"{owner.name}-kvtier"
    env = [_config_env("KVTIER_KV_TRANSFER_CONFIG", config_name, KV_TRANSFER_KEY)]
    args = [
        "--model", weights.model, *weights.args,
        "--revision", recipe.model.revision,
        "--port", str(ENGINE_PORT),
        "--kv-transfer-config", "$(KVTIER_KV_TRANSFER_CONFIG)",
    ]  # fmt: skip
    if recipe.cache.encoder_cache:
        env.append(_config_env("KVTIER_EC_TRANSFER_CONFIG", config_name, EC_TRANSFER_KEY))
        args += ["--ec-transfer-config", "$(KVTIER_EC_TRANSFER_CONFIG)"]
    args += recipe.engine.args
    # A read-only root filesystem: vLLM, Hugging Face, torch and Triton write their
    # caches under HOME, temporary files under /tmp, shared tensors under /dev/shm.
    env += [
        {"name": "HOME", "value": ENGINE_HOME},
        {"name": "USER", "value": "vllm"},  # getpass.getuser() without a passwd entry
        *weights.env,
    ]
    mounts: list[Obj] = [
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "home", "mountPath": ENGINE_HOME},
        {"name": "tmp", "mountPath": TMP_DIR},
        *weights.mounts,
    ]
    volumes: list[Obj] = [
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
        {"name": "home", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        *weights.volumes,
    ]
    per_node = tier is not None and tier.per_node
    if per_node:  # the node's tier socket, where a tier pod runs on the engine's node
        mounts.append(topology.socket_mount())
        volumes.append(topology.socket_volume(recipe.owner.namespace, recipe.tier_name))
    if tier is not None and tier.auth_secret is not None:
        mounts.append({"name": "kvtier-auth", "mountPath": AUTH_DIR, "readOnly": True})
        volumes.append(
            _secret_volume("kvtier-auth", tier.auth_secret, [recipe.cache.tenant], ["token"])
        )
    _mount_certificates(engine_certificates(recipe, tier), mounts, volumes)
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
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }
    pod_labels = labels(owner, "engine")
    deployment_spec: Obj = {
        "replicas": recipe.engine.replicas,
        "selector": {"matchLabels": selector(owner, "engine")},
        "template": {
            "metadata": {
                "labels": pod_labels,
                "annotations": {
                    SETTINGS_HASH_ANNOTATION: _digest(config),
                    **(
                        {CERTIFICATES_HASH_ANNOTATION: certificates_hash}
                        if certificates_hash
                        else {}
                    ),
                },
            },
            "spec": {
                "enableServiceLinks": False,
                "automountServiceAccountToken": False,
                "securityContext": _engine_pod_security(weights, per_node=per_node),
                "containers": [container],
                "volumes": volumes,
            },
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
    if weights.owned_claim is not None:
        assert recipe.model.cache is not None
        children.insert(0, _object(
            "v1", "PersistentVolumeClaim", weights.owned_claim, owner, "engine",
            spec=model_cache_claim_spec(recipe.model.cache),
        ))  # fmt: skip
    if recipe.inline_tier is not None:
        children.insert(0, inline_cache_tier(recipe))
    return children


def _engine_pod_security(weights: EngineWeights, *, per_node: bool) -> Obj:
    security = pod_security(ENGINE_UID)
    if per_node:  # the tier's group may use its socket (0660, in a 0750 directory)
        security["supplementalGroups"] = [TIER_UID]
    if weights.shared_volumes:
        # A model or cache volume can hold many large files: give them the pod's group only
        # when the volume's root does not have it yet, not file by file at every start.
        security["fsGroupChangePolicy"] = "OnRootMismatch"
    return security


def inline_cache_tier(recipe: ModelRecipe) -> Obj:
    """The dedicated CacheTier of a recipe with spec.tier.inline."""
    assert recipe.inline_tier is not None
    return _object(
        API_VERSION, "CacheTier", recipe.tier_name, recipe.owner, "cache-tier",
        spec=copy.deepcopy(dict(recipe.inline_tier)),
    )  # fmt: skip


def kv_transfer_config(recipe: ModelRecipe, tier: TierSpec | None) -> Obj:
    """vLLM's --kv-transfer-config for the kvtier connector."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": _connector_extra(recipe, tier),
    }


def ec_transfer_config(recipe: ModelRecipe, tier: TierSpec | None) -> Obj:
    """vLLM's --ec-transfer-config for the kvtier encoder-cache connector."""
    return {
        "ec_connector": "KvtierECConnector",
        "ec_connector_module_path": "kvtier.connector.ec",
        "ec_role": "ec_both",
        "ec_connector_extra_config": _connector_extra(recipe, tier),
    }


def _connector_extra(recipe: ModelRecipe, tier: TierSpec | None) -> Obj:
    """The connector's settings (``kvtier.connector.config.ConnectorConfig``)."""
    policy = recipe.cache.salt_policy
    extra: Obj = {
        "target": tier_endpoint(recipe.tier_name, recipe.owner.namespace),
        "chunk_size": recipe.cache.chunk_size,
        "codec": recipe.cache.codec,
        # namespace: the connector's request policy plus a fixed salt, the namespace.
        "salt_policy": "request" if policy == "namespace" else policy,
    }
    if policy == "namespace":
        extra["salt"] = recipe.owner.namespace
    model_id = engine_weights(recipe).model_id
    if model_id is not None:  # --model is a path: key entries by the model's name
        extra["model_id"] = model_id
    if tier is not None and tier.per_node:  # tried first; target where it does not answer
        extra["local_socket"] = topology.LOCAL_SOCKET
    if tier is not None and tier.auth_secret is not None:
        extra["auth_token_file"] = AUTH_FILE
    if tier is not None and tier.tls is not None:
        extra["tls_ca_file"] = f"{TLS_DIR}/{TLS_CA_KEY}"
        if recipe.cache.client_cert_secret is not None:
            extra["tls_cert_file"] = f"{CLIENT_TLS_DIR}/{TLS_CERT_KEY}"
            extra["tls_key_file"] = f"{CLIENT_TLS_DIR}/{TLS_KEY_KEY}"
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


def _tier_probe(features: ClusterFeatures, spec: TierSpec, *, period: int, failures: int) -> Obj:
    # grpc.health.v1 on the gRPC port; a TCP check where the API server predates gRPC probes,
    # or where the tier speaks TLS (the kubelet's gRPC probe speaks plaintext only).
    check: Obj = (
        {"grpc": {"port": TIER_PORT}}
        if features.grpc_probes and spec.tls is None
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


def pod_security(uid: int) -> Obj:
    """A pod's part of the Pod Security "restricted" profile, as ``uid`` (fsGroup: the
    volumes are writable by it)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> Obj:
    """A container's part of the Pod Security "restricted" profile, root filesystem read-only."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _mount_certificates(certificates: Certificates, mounts: list[Obj], volumes: list[Obj]) -> None:
    for volume, secret, keys, path in certificates.mounts:
        mounts.append({"name": volume, "mountPath": path, "readOnly": True})
        volumes.append(_secret_volume(volume, secret, list(keys)))


def _secret_volume(name: str, secret: str, keys: list[str], paths: list[str] | None = None) -> Obj:
    """A volume of only ``keys`` of ``secret`` (as files ``paths``, default the key names)."""
    items = [{"key": key, "path": path} for key, path in zip(keys, paths or keys, strict=True)]
    return {"name": name, "secret": {"secretName": secret, "items": items}}


def _secret_env(name: str, ref: SecretKeyRef) -> Obj:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def _config_env(name: str, config_map: str, key: str) -> Obj:
    return {"name": name, "valueFrom": {"configMapKeyRef": {"name": config_map, "key": key}}}


def _digest(data: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
