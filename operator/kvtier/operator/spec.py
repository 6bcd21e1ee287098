"""Typed specs of the custom resources, parsed from their bodies.

The API server validates and defaults every field its CRD schema can express
(``crds/*.yaml``); ``parse_cache_tier`` and ``parse_model_recipe`` apply the same
defaults (so plain dicts work in tests) and check what the schema cannot: the
combinations of fields. A ``SpecError`` names the field and what to do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from kvtier.operator.errors import SpecError
from kvtier.operator.quantity import parse_bytes

GROUP = "kvtier.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

ENGINE_KINDS = ("vllm",)
MODALITIES = ("text", "image", "audio", "video")
CODECS = ("raw", "zstd")  # the connector's codecs (kv_connector_extra_config.codec)
# request/none/required are the connector's salt policies; namespace is request plus a fixed
# salt (the recipe's namespace).
SALT_POLICIES = ("request", "namespace", "none", "required")
GPU_RESOURCE = "nvidia.com/gpu"
MAX_NAME_LENGTH = 40
INLINE_TIER_SUFFIX = "-tier"

# Defaults, identical to the CRD schemas' (a test compares them).
DEFAULT_RAM = "2Gi"
DEFAULT_DISK_SIZE = "20Gi"
DEFAULT_REVISION = "main"
DEFAULT_CHUNK_SIZE = 256
DEFAULT_TENANT = "default"
DEFAULT_TOKEN_KEY = "token"  # spec.model.tokenSecretRef.key
MODEL_CACHE_ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce")
SHARED, PER_NODE = "shared", "perNode"
TOPOLOGIES = (SHARED, PER_NODE)  # a StatefulSet of replicas, or a DaemonSet: one pod per node
TOLERATION_OPERATORS = ("Equal", "Exists")
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
TLS_CERT_KEY, TLS_KEY_KEY, TLS_CA_KEY = "tls.crt", "tls.key", "ca.crt"  # kubernetes.io/tls + ca.crt
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")  # kvtier server's tenant names

Body = Mapping[str, Any]


@dataclass(frozen=True)
class Owner:
    """Identity of a custom resource, for its children's names and owner references."""

    kind: str
    name: str
    namespace: str
    uid: str
    generation: int


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class Resources:
    """Container resources as given (quantities stay strings or integers)."""

    requests: Mapping[str, int | str]
    limits: Mapping[str, int | str]


@dataclass(frozen=True)
class Disk:
    enabled: bool
    size: int | str  # as written, for the PersistentVolumeClaim
    size_bytes: int
    storage_class: str | None


@dataclass(frozen=True)
class Redis:
    url: str
    cluster: bool
    password: SecretKeyRef | None


@dataclass(frozen=True)
class Tls:
    """A tier's TLS: a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt."""

    secret: str
    client_auth: bool  # mutual TLS: clients need a certificate signed by ca.crt


@dataclass(frozen=True)
class TierSpec:
    """A CacheTier's spec (also ModelRecipe's spec.tier.inline)."""

    replicas: int
    image: str | None
    ram_bytes: int
    disk: Disk
    redis: Redis | None
    auth_secret: str | None  # a Secret with one key per tenant, its token as the value
    metrics: bool
    resources: Resources | None
    tls: Tls | None = None
    data_port: bool = True
    ram_recycle_bytes: int | None = None  # None: the server's default
    tenant_quota_bytes: int = 0  # most bytes one tenant may hold in each tier; 0: no quota
    topology: str = SHARED
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()

    @property
    def per_node(self) -> bool:
        return self.topology == PER_NODE

    def secret_refs(self) -> list[tuple[str, SecretKeyRef]]:
        """The Secret keys the tier needs, with the field that names them (the auth Secret's
        keys are its tenants: any number of them). The TLS Secret's ca.crt is needed even
        without client auth: it is what the engines verify the tier with."""
        refs: list[tuple[str, SecretKeyRef]] = []
        if self.redis is not None and self.redis.password is not None:
            refs.append(("spec.redis.passwordSecretRef", self.redis.password))
        if self.tls is not None:
            for key in (TLS_CERT_KEY, TLS_KEY_KEY, TLS_CA_KEY):
                refs.append(("spec.tls.secretName", SecretKeyRef(self.tls.secret, key)))
        return refs


@dataclass(frozen=True)
class CacheTier:
    owner: Owner
    spec: TierSpec


@dataclass(frozen=True)
class ModelVolume:
    """Weights on a PersistentVolumeClaim: ``path`` is a directory inside it ("": its root)."""

    claim: str
    path: str


@dataclass(frozen=True)
class ModelCache:
    """The Hugging Face cache (HF_HOME) the engine replicas share: an existing claim, or one
    the operator creates (``<recipe>-model-cache``) of ``size``."""

    claim: str | None
    size: int | str | None  # as written, for the PersistentVolumeClaim
    storage_class: str | None
    access_mode: str


@dataclass(frozen=True)
class Model:
    repo: str  # the hub repository, and the name clients use (--served-model-name)
    revision: str
    architecture: str
    modalities: tuple[str, ...]
    volume: ModelVolume | None = None  # weights from a volume instead of the hub
    token: SecretKeyRef | None = None  # HF_TOKEN, for gated hub models
    cache: ModelCache | None = None

    def claims(self) -> list[tuple[str, str]]:
        """The existing PersistentVolumeClaims the engines mount, with the field naming them."""
        out = []
        if self.volume is not None:
            out.append(("spec.model.volume.claimName", self.volume.claim))
        if self.cache is not None and self.cache.claim is not None:
            out.append(("spec.model.cache.claimName", self.cache.claim))
        return out


@dataclass(frozen=True)
class Engine:
    kind: str
    image: str
    args: tuple[str, ...]
    replicas: int
    gpus: int
    resources: Resources | None


@dataclass(frozen=True)
class Cache:
    chunk_size: int
    codec: str
    salt_policy: str
    encoder_cache: bool
    tenant: str  # the key of the tier's auth Secret the engines authenticate with
    client_cert_secret: str | None = None  # kubernetes.io/tls: presented to a TLS tier


@dataclass(frozen=True)
class ModelRecipe:
    owner: Owner
    model: Model
    engine: Engine
    cache: Cache
    tier_name: str  # the referenced CacheTier, or the dedicated one made from inline
    inline_tier: Mapping[str, Any] | None  # spec.tier.inline as written, for the child CacheTier


def parse_cache_tier(body: Body) -> CacheTier:
    """Parse a CacheTier body; SpecError names the first invalid field."""
    return CacheTier(owner=_owner(body), spec=parse_tier_spec(_object(body, "spec"), "spec"))


def parse_model_recipe(body: Body) -> ModelRecipe:
    """Parse a ModelRecipe body; SpecError names the first invalid field."""
    owner = _owner(body)
    spec = _object(body, "spec")
    model = _parse_model(_object(spec, "model", "spec.model"))
    engine = _parse_engine(_object(spec, "engine", "spec.engine"))
    cache = _parse_cache(_object(spec, "cache", "spec.cache", required=False))
    if cache.encoder_cache and set(model.modalities) == {"text"}:
        raise SpecError(
            "spec.cache.encoderCache",
            "the encoder cache needs a multimodal model: add image, audio or video to "
            "spec.model.modalities, or set encoderCache to false",
        )
    if set(model.modalities) != {"text"} and _names_items_per_request(engine.args):
        raise SpecError(
            "spec.engine.args",
            "turn off at most one of vLLM's prefix cache and multimodal processor cache: with "
            "both off (--no-enable-prefix-caching and --mm-processor-cache-gb 0) vLLM names each "
            "image after its request instead of its content, and the kvtier connector refuses to "
            "start; drop one of the two flags",
        )
    tier = _object(spec, "tier", "spec.tier")
    has_ref, has_inline = "ref" in tier, "inline" in tier
    if has_ref == has_inline:
        raise SpecError(
            "spec.tier",
            "set exactly one of ref (a shared CacheTier) and inline (a dedicated tier)",
        )
    inline: Mapping[str, Any] | None = None
    if has_ref:
        tier_name = _str(_object(tier, "ref", "spec.tier.ref"), "name", "spec.tier.ref.name")
    else:
        inline = _object(tier, "inline", "spec.tier.inline")
        parse_tier_spec(inline, "spec.tier.inline")  # validate now, reconciled as its own CacheTier
        tier_name = owner.name + INLINE_TIER_SUFFIX
    return ModelRecipe(owner, model, engine, cache, tier_name, inline)


def parse_tier_spec(spec: Body, path: str) -> TierSpec:
    replicas = _int(spec, "replicas", f"{path}.replicas", default=1, minimum=1)
    image = spec.get("image")
    if image is not None and not (isinstance(image, str) and image):
        raise SpecError(f"{path}.image", "expected a container image reference")
    ram_bytes = _bytes(spec.get("ramBytes", DEFAULT_RAM), f"{path}.ramBytes")
    recycle = spec.get("ramRecycleBytes")
    if recycle is not None and recycle not in (0, "0"):
        recycle = _bytes(recycle, f"{path}.ramRecycleBytes")
    disk_spec = _object(spec, "disk", f"{path}.disk", required=False)
    disk_size = disk_spec.get("size", DEFAULT_DISK_SIZE)
    disk = Disk(
        enabled=_bool(disk_spec, "enabled", f"{path}.disk.enabled", default=True),
        size=disk_size,
        size_bytes=_bytes(disk_size, f"{path}.disk.size"),
        storage_class=_optional_str(disk_spec, "storageClassName", f"{path}.disk.storageClassName"),
    )
    redis: Redis | None = None
    if "redis" in spec:
        redis_spec = _object(spec, "redis", f"{path}.redis")
        url = _str(redis_spec, "url", f"{path}.redis.url")
        if not url.startswith(("redis://", "rediss://")):
            raise SpecError(
                f"{path}.redis.url", f"expected a redis:// or rediss:// URL, got {url!r}"
            )
        redis = Redis(
            url=url,
            cluster=_bool(redis_spec, "cluster", f"{path}.redis.cluster", default=False),
            password=_secret_ref(redis_spec, "passwordSecretRef", f"{path}.redis", "password"),
        )
    metrics = _object(spec, "metrics", f"{path}.metrics", required=False)
    return TierSpec(
        replicas=replicas,
        image=image,
        ram_bytes=ram_bytes,
        disk=disk,
        redis=redis,
        auth_secret=_secret_name(spec, "authSecretRef", path),
        metrics=_bool(metrics, "enabled", f"{path}.metrics.enabled", default=True),
        resources=_resources(spec, f"{path}.resources"),
        tls=_tls(spec, f"{path}.tls"),
        data_port=_data_port(spec, replicas, shared=redis is not None, path=path),
        ram_recycle_bytes=None if recycle is None else int(recycle),
        tenant_quota_bytes=_zero_or_bytes(spec.get("tenantQuotaBytes", 0), f"{path}.tenantQuotaBytes"),
        topology=_topology(spec, disk, shared=redis is not None, path=path),
        node_selector=_string_map(spec, "nodeSelector", f"{path}.nodeSelector"),
        tolerations=_tolerations(spec, f"{path}.tolerations"),
    )


def _topology(spec: Body, disk: Disk, *, shared: bool, path: str) -> str:
    """``shared`` (a StatefulSet) or ``perNode`` (a DaemonSet, its socket in a node-local
    directory), which needs Redis: the pods of different nodes share only through it."""
    topology = _choice(spec, "topology", f"{path}.topology", TOPOLOGIES)
    if topology != PER_NODE:
        return topology
    if not shared:
        raise SpecError(
            f"{path}.topology",
            f"a per-node tier needs {path}.redis: engines reach other nodes' data only through "
            "the Redis below every node's tier (a Redis Cluster for several nodes); add "
            f"{path}.redis or use topology: shared",
        )
    if disk.enabled and disk.storage_class is not None:
        raise SpecError(
            f"{path}.disk.storageClassName",
            "a per-node tier keeps its disk tier in an emptyDir on the node (a DaemonSet has no "
            "volume claims): remove storageClassName, or turn the disk off",
        )
    return topology


def _string_map(parent: Body, key: str, path: str) -> dict[str, str]:
    values = _object(parent, key, path, required=False)
    for name, value in values.items():
        if not isinstance(value, str):
            raise SpecError(f"{path}.{name}", f"expected a string, got {value!r}")
    return dict(values)


def _tolerations(parent: Body, path: str) -> tuple[Mapping[str, Any], ...]:
    tolerations = parent.get("tolerations", [])
    if not isinstance(tolerations, list):
        raise SpecError(path, "expected a list of tolerations, as in a Pod")
    out = []
    for i, toleration in enumerate(tolerations):
        where = f"{path}[{i}]"
        if not isinstance(toleration, Mapping):
            raise SpecError(where, "expected a toleration object")
        if toleration.get("operator", "Equal") not in TOLERATION_OPERATORS:
            raise SpecError(f"{where}.operator", f"expected one of {TOLERATION_OPERATORS}")
        effect = toleration.get("effect")
        if effect is not None and effect not in TOLERATION_EFFECTS:
            raise SpecError(f"{where}.effect", f"expected one of {TOLERATION_EFFECTS}")
        out.append(dict(toleration))
    return tuple(out)


def _zero_or_bytes(value: object, path: str) -> int:
    return 0 if value in (0, "0") else _bytes(value, path)


def _data_port(spec: Body, replicas: int, *, shared: bool, path: str) -> bool:
    """Whether the tier serves its data port. Unset: on, except for several replicas without
    Redis, where an engine's data-port and gRPC connections can reach different replicas
    (separate caches: what one connection saved, the other would not find)."""
    field = f"{path}.dataPort.enabled"
    coherent = replicas == 1 or shared
    if "enabled" not in _object(spec, "dataPort", f"{path}.dataPort", required=False):
        return coherent
    enabled = _bool(spec["dataPort"], "enabled", field, default=True)
    if enabled and not coherent:
        raise SpecError(
            field,
            f"with {replicas} replicas and no {path}.redis, an engine's data-port and gRPC "
            "connections can reach different replicas, each a separate cache: set it to false "
            "(or leave it unset), add a Redis, or run one replica",
        )
    return enabled


def _tls(parent: Body, path: str) -> Tls | None:
    if "tls" not in parent:
        return None
    spec = _object(parent, "tls", path)
    return Tls(
        secret=_str(spec, "secretName", f"{path}.secretName"),
        client_auth=_bool(spec, "clientAuth", f"{path}.clientAuth", default=False),
    )


def _parse_model(spec: Body) -> Model:
    modalities = spec.get("modalities", ["text"])
    if not isinstance(modalities, list) or not modalities:
        raise SpecError("spec.model.modalities", f"expected a non-empty list of {MODALITIES}")
    for modality in modalities:
        if modality not in MODALITIES:
            raise SpecError(
                "spec.model.modalities", f"unknown modality {modality!r}: use {MODALITIES}"
            )
    volume = _model_volume(spec)
    token = _secret_ref(spec, "tokenSecretRef", "spec.model", DEFAULT_TOKEN_KEY)
    cache = _model_cache(spec)
    if volume is not None:
        for field, value in (("tokenSecretRef", token), ("cache", cache)):
            if value is not None:
                raise SpecError(
                    f"spec.model.{field}",
                    "the weights come from spec.model.volume and the engines run offline "
                    "(HF_HUB_OFFLINE=1): a hub token and a download cache are for hub models; "
                    f"remove spec.model.{field} or spec.model.volume",
                )
    return Model(
        repo=_str(spec, "repo", "spec.model.repo"),
        revision=_str(spec, "revision", "spec.model.revision", default=DEFAULT_REVISION),
        architecture=_str(spec, "architecture", "spec.model.architecture"),
        modalities=tuple(modalities),
        volume=volume,
        token=token,
        cache=cache,
    )


def _model_volume(spec: Body) -> ModelVolume | None:
    if "volume" not in spec:
        return None
    volume = _object(spec, "volume", "spec.model.volume")
    path = volume.get("path", "")
    if not isinstance(path, str):
        raise SpecError("spec.model.volume.path", f"expected a string, got {path!r}")
    parts = PurePosixPath(path).parts
    if path.startswith("/") or ".." in parts or any(c.isspace() for c in path):
        raise SpecError(
            "spec.model.volume.path",
            f"expected a directory relative to the volume's root, without '..' or spaces "
            f"(google/gemma-3-4b-it), got {path!r}",
        )
    return ModelVolume(
        claim=_str(volume, "claimName", "spec.model.volume.claimName"),
        path="/".join(part for part in parts if part != "."),
    )


def _model_cache(spec: Body) -> ModelCache | None:
    if "cache" not in spec:
        return None
    cache = _object(spec, "cache", "spec.model.cache")
    claim = _optional_str(cache, "claimName", "spec.model.cache.claimName")
    size = cache.get("size")
    if (claim is None) == (size is None):
        raise SpecError(
            "spec.model.cache",
            "set exactly one of claimName (an existing PersistentVolumeClaim) and size "
            "(the operator creates the claim <recipe>-model-cache)",
        )
    if size is not None:
        _bytes(size, "spec.model.cache.size")
    elif "storageClassName" in cache or "accessMode" in cache:
        raise SpecError(
            "spec.model.cache.claimName",
            "storageClassName and accessMode describe a claim the operator creates (with "
            "size); an existing claim keeps its own",
        )
    return ModelCache(
        claim=claim,
        size=size,
        storage_class=_optional_str(cache, "storageClassName", "spec.model.cache.storageClassName"),
        access_mode=_choice(cache, "accessMode", "spec.model.cache.accessMode",
                            MODEL_CACHE_ACCESS_MODES),
    )


def _names_items_per_request(args: tuple[str, ...]) -> bool:
    """Whether vLLM, started with ``args``, runs with both its prefix cache and its
    multimodal processor cache off (the last occurrence of a flag wins, as in argparse)."""
    prefix_caching, processor_cache_gb = True, 4.0  # vLLM's defaults
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg.partition("=")
        name = name.replace("_", "-")
        if name == "--enable-prefix-caching":
            prefix_caching = value.lower() not in ("false", "0") if eq else True
        elif name == "--no-enable-prefix-caching":
            prefix_caching = False
        elif name == "--mm-processor-cache-gb":
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
            try:
                processor_cache_gb = float(value)
            except ValueError:
                continue  # vLLM itself rejects it, naming the flag
    return not prefix_caching and processor_cache_gb == 0


def _parse_engine(spec: Body) -> Engine:
    kind = _str(spec, "kind", "spec.engine.kind", default="vllm")
    if kind not in ENGINE_KINDS:
        raise SpecError(
            "spec.engine.kind", f"engine {kind!r} is not supported: use one of {ENGINE_KINDS}"
        )
    args = spec.get("args", [])
    if not isinstance(args, list) or not all(isinstance(arg, str) for arg in args):
        raise SpecError("spec.engine.args", "expected a list of strings")
    resources = _resources(spec, "spec.engine.resources")
    if resources is not None and (
        GPU_RESOURCE in resources.requests or GPU_RESOURCE in resources.limits
    ):
        raise SpecError(
            "spec.engine.resources", f"set GPUs with spec.engine.gpus, not {GPU_RESOURCE}"
        )
    return Engine(
        kind=kind,
        image=_str(spec, "image", "spec.engine.image"),
        args=tuple(args),
        replicas=_int(spec, "replicas", "spec.engine.replicas", default=1, minimum=0),
        gpus=_int(spec, "gpus", "spec.engine.gpus", default=1, minimum=0),
        resources=resources,
    )


def _parse_cache(spec: Body) -> Cache:
    chunk_size = _int(
        spec, "chunkSize", "spec.cache.chunkSize", default=DEFAULT_CHUNK_SIZE, minimum=16
    )
    if chunk_size % 16:
        raise SpecError("spec.cache.chunkSize", f"expected a multiple of 16, got {chunk_size}")
    return Cache(
        chunk_size=chunk_size,
        codec=_choice(spec, "codec", "spec.cache.codec", CODECS),
        salt_policy=_choice(spec, "saltPolicy", "spec.cache.saltPolicy", SALT_POLICIES),
        encoder_cache=_bool(spec, "encoderCache", "spec.cache.encoderCache", default=False),
        tenant=_tenant(spec),
        client_cert_secret=_secret_name(spec, "clientCertSecretRef", "spec.cache"),
    )


def _tenant(spec: Body) -> str:
    tenant = _str(spec, "tenant", "spec.cache.tenant", default=DEFAULT_TENANT)
    if not TENANT_RE.match(tenant):
        raise SpecError(
            "spec.cache.tenant",
            f"{tenant!r} is not a tenant name: 1-253 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
        )
    return tenant


def _secret_name(parent: Body, key: str, path: str) -> str | None:
    """The name of a ``{key}: {name: ...}`` Secret reference, or None without one."""
    if key not in parent:
        return None
    return _str(_object(parent, key, f"{path}.{key}"), "name", f"{path}.{key}.name")


def _owner(body: Body) -> Owner:
    meta = _object(body, "metadata")
    name = _str(meta, "name", "metadata.name")
    if len(name) > MAX_NAME_LENGTH:
        raise SpecError("metadata.name", f"at most {MAX_NAME_LENGTH} characters, got {len(name)}")
    return Owner(
        kind=_str(body, "kind", "kind"),
        name=name,
        namespace=_str(meta, "namespace", "metadata.namespace"),
        uid=_str(meta, "uid", "metadata.uid"),
        generation=_int(meta, "generation", "metadata.generation", default=1, minimum=0),
    )


def _object(parent: Body, key: str, path: str | None = None, *, required: bool = True) -> Body:
    value = parent.get(key)
    if value is None:
        if required:
            raise SpecError(path or key, "required")
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(path or key, f"expected an object, got {type(value).__name__}")
    return value


def _str(parent: Body, key: str, path: str, *, default: str | None = None) -> str:
    value = parent.get(key, default)
    if not isinstance(value, str) or not value:
        raise SpecError(path, "required" if value is None else "expected a non-empty string")
    return value


def _optional_str(parent: Body, key: str, path: str) -> str | None:
    return _str(parent, key, path) if key in parent else None


def _int(parent: Body, key: str, path: str, *, default: int, minimum: int) -> int:
    value = parent.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(path, f"expected an integer, got {value!r}")
    if value < minimum:
        raise SpecError(path, f"expected at least {minimum}, got {value}")
    return value


def _bool(parent: Body, key: str, path: str, *, default: bool) -> bool:
    value = parent.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(path, f"expected true or false, got {value!r}")
    return value


def _choice(parent: Body, key: str, path: str, choices: tuple[str, ...]) -> str:
    value = parent.get(key, choices[0])
    if value not in choices:
        raise SpecError(path, f"expected one of {choices}, got {value!r}")
    return str(value)


def _bytes(value: object, path: str) -> int:
    if not isinstance(value, int | str):
        raise SpecError(path, f"expected a quantity such as 2Gi, got {value!r}")
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise SpecError(path, str(exc)) from exc


def _secret_ref(parent: Body, key: str, path: str, default_key: str) -> SecretKeyRef | None:
    if key not in parent:
        return None
    ref = _object(parent, key, f"{path}.{key}")
    return SecretKeyRef(
        name=_str(ref, "name", f"{path}.{key}.name"),
        key=_str(ref, "key", f"{path}.{key}.key", default=default_key),
    )


def _resources(parent: Body, path: str) -> Resources | None:
    if "resources" not in parent:
        return None
    spec = _object(parent, "resources", path)
    parts: dict[str, dict[str, int | str]] = {}
    for part in ("requests", "limits"):
        values = _object(spec, part, f"{path}.{part}", required=False)
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise SpecError(f"{path}.{part}.{name}", f"expected a quantity, got {value!r}")
        parts[part] = dict(values)
    return Resources(requests=parts["requests"], limits=parts["limits"])
