"""One reconcile of a CacheTier or a ModelRecipe: parse, compute, apply, observe, report.

Create, update, resume and the drift timer all call these: every step is
idempotent (server-side apply of the whole desired object). Problems a user
must fix (an invalid spec, a missing Secret or tier, a name taken by someone
else's object) end in the returned status, not in an exception; API errors
are raised for kopf to retry.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.operator import conditions as cond
from kvtier.operator.children import (
    Certificates,
    ClusterFeatures,
    cache_tier_children,
    engine_certificates,
    engine_endpoint,
    model_recipe_children,
    tier_certificates,
    tier_endpoint,
)
from kvtier.operator.conditions import Condition
from kvtier.operator.errors import ChildConflict, Invalid, KubeError, SpecError
from kvtier.operator.kube import Kind, KubeClient, kind_for, kind_of
from kvtier.operator.scrape import MetricsReader
from kvtier.operator.spec import (
    API_VERSION,
    INLINE_TIER_SUFFIX,
    TLS_CERT_KEY,
    TLS_KEY_KEY,
    ModelRecipe,
    Owner,
    TierSpec,
    parse_cache_tier,
    parse_model_recipe,
    parse_tier_spec,
)

logger = logging.getLogger(__name__)

Obj = dict[str, Any]
CACHE_TIER = kind_of(API_VERSION, "CacheTier")
SECRET = kind_of("v1", "Secret")
CLAIM = kind_of("v1", "PersistentVolumeClaim")
STATEFULSET = kind_of("apps/v1", "StatefulSet")
DAEMONSET = kind_of("apps/v1", "DaemonSet")
CREATE_ONCE = frozenset({"PersistentVolumeClaim"})  # specs the API server keeps immutable
TIER_CONDITIONS = ("Ready",)
RECIPE_CONDITIONS = ("TierReady", "EngineReady", "Ready")
TIER_FACTS = ("endpoint", "replicas", "readyReplicas")
RECIPE_FACTS = ("tier", "tierEndpoint", "endpoint", "replicas", "availableReplicas")


@dataclass(frozen=True)
class Context:
    """What a reconcile needs besides the custom resource."""

    client: KubeClient
    tier_image: str
    features: ClusterFeatures
    metrics: MetricsReader | None = None  # reads pods' /metrics for status.traffic


async def reconcile_cache_tier(ctx: Context, body: Mapping[str, Any]) -> Obj:
    """Bring a CacheTier's children to their desired state; return its new status."""
    try:
        tier = parse_cache_tier(body)
    except SpecError as exc:
        return _status(body, cond.failed(TIER_CONDITIONS, "InvalidSpec", str(exc)))
    owner = tier.owner
    endpoint = {"endpoint": tier_endpoint(owner.name, owner.namespace)}
    secret_problem = await _check_secrets(ctx.client, owner.namespace, tier.spec)
    certificates = await _certificates_hash(
        ctx.client, owner.namespace, tier_certificates(tier.spec)
    )
    children = cache_tier_children(tier, ctx.tier_image, ctx.features, certificates)
    try:
        applied = await apply_children(ctx.client, owner, children)
    except ChildConflict as exc:
        return _status(body, cond.failed(TIER_CONDITIONS, "ChildConflict", str(exc)), **endpoint)
    # A tier switching topology drops the workload of the other one.
    other = STATEFULSET if tier.spec.per_node else DAEMONSET
    await _delete_controlled(ctx.client, other, owner)
    if tier.spec.per_node:
        daemonset = applied[("DaemonSet", owner.name)]
        ready = secret_problem or cond.per_node_tier_ready(daemonset)
        desired, ready_replicas, _ = cond.daemonset_rollout(daemonset)
    else:
        statefulset = applied[("StatefulSet", owner.name)]
        ready = secret_problem or cond.tier_ready(statefulset)
        desired, ready_replicas, _ = cond.rollout(statefulset, "readyReplicas")
    return _status(body, [ready], **endpoint, replicas=desired, readyReplicas=ready_replicas)


async def _delete_controlled(client: KubeClient, kind: Kind, owner: Owner) -> None:
    existing = await client.get(kind, owner.namespace, owner.name)
    if existing is not None and _controlled_by(existing, owner):
        logger.info("deleting %s %s/%s", kind.kind, owner.namespace, owner.name)
        await client.delete(kind, owner.namespace, owner.name)


async def reconcile_model_recipe(ctx: Context, body: Mapping[str, Any]) -> Obj:
    """Bring a ModelRecipe's children to their desired state; return its new status."""
    try:
        recipe = parse_model_recipe(body)
    except SpecError as exc:
        return _status(body, cond.failed(RECIPE_CONDITIONS, "InvalidSpec", str(exc)))
    owner = recipe.owner
    facts: Obj = {
        "tier": recipe.tier_name,
        "tierEndpoint": tier_endpoint(recipe.tier_name, owner.namespace),
        "endpoint": engine_endpoint(owner.name, owner.namespace),
    }
    if recipe.inline_tier is None:
        await _delete_inline_tier(ctx.client, owner)
        cache_tier = await ctx.client.get(CACHE_TIER, owner.namespace, recipe.tier_name)
    else:
        cache_tier = None  # applied below, with the other children
    tier = _tier_spec(recipe.inline_tier if cache_tier is None else cache_tier.get("spec"))
    access_problem = None if tier is None else await _check_access(ctx.client, recipe, tier)
    weights_problem = await _check_weights(ctx.client, recipe)
    certificates = await _certificates_hash(
        ctx.client, owner.namespace, engine_certificates(recipe, tier)
    )
    try:
        applied = await apply_children(
            ctx.client, owner, model_recipe_children(recipe, tier, certificates)
        )
    except ChildConflict as exc:
        return _status(body, cond.failed(RECIPE_CONDITIONS, "ChildConflict", str(exc)), **facts)
    cache_tier = applied.get(("CacheTier", recipe.tier_name), cache_tier)
    deployment = applied[("Deployment", owner.name)]
    tier_ready = access_problem or cond.tier_ready_for_recipe(recipe.tier_name, cache_tier)
    engine_ready = weights_problem or cond.engine_ready(deployment)
    desired, available, _ = cond.rollout(deployment, "availableReplicas")
    return _status(
        body,
        [tier_ready, engine_ready, cond.all_ready([tier_ready, engine_ready])],
        **facts, replicas=desired, availableReplicas=available,
    )  # fmt: skip


async def apply_children(
    client: KubeClient, owner: Owner, children: Sequence[Obj]
) -> dict[tuple[str, str], Obj]:
    """Server-side apply each child; the applied objects by (kind, name).

    A child whose name is taken by an object this owner does not control raises
    ``ChildConflict`` instead of being taken over.
    """
    applied = {}
    for child in children:
        kind, meta = kind_for(child), child["metadata"]
        existing = await client.get(kind, meta["namespace"], meta["name"])
        if existing is not None and not _controlled_by(existing, owner):
            raise ChildConflict(child["kind"], meta["name"])
        if child["kind"] in CREATE_ONCE:
            # Created once and then left alone: its spec cannot change (a larger claim is
            # resized on the claim itself, where the StorageClass allows it).
            applied[(child["kind"], meta["name"])] = existing or await client.create(child)
            continue
        applied[(child["kind"], meta["name"])] = await _apply(client, kind, child)
    return applied


async def _apply(client: KubeClient, kind: Kind, child: Obj) -> Obj:
    try:
        return await client.apply(child)
    except Invalid:
        if child["kind"] != "StatefulSet":
            raise
        # A change to an immutable StatefulSet field (the disk's volume claim template):
        # replace the StatefulSet and keep its pods and volumes, which the new one adopts.
        meta = child["metadata"]
        logger.info(
            "replacing StatefulSet %s/%s to change an immutable field",
            meta["namespace"],
            meta["name"],
        )
        await client.delete(kind, meta["namespace"], meta["name"], propagation="Orphan")
        await _wait_until_gone(client, kind, meta["namespace"], meta["name"])
        return await client.apply(child)


async def _wait_until_gone(
    client: KubeClient, kind: Kind, namespace: str, name: str, *, within: float = 30
) -> None:
    """Wait out an orphaning delete (the garbage collector first frees the dependents)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while await client.get(kind, namespace, name) is not None:
        if loop.time() > deadline:
            raise KubeError(0, "Timeout", f"{kind.kind} {namespace}/{name} is still being deleted")
        await asyncio.sleep(0.2)


def _controlled_by(obj: Mapping[str, Any], owner: Owner) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == owner.uid and ref.get("controller") for ref in refs)


async def _check_secrets(client: KubeClient, namespace: str, spec: TierSpec) -> Condition | None:
    """A ``Ready`` failure for the first Secret key the tier needs and cannot find."""
    if spec.auth_secret is not None:
        secret = await client.get(SECRET, namespace, spec.auth_secret)
        if secret is None:
            return Condition(
                "Ready", cond.FALSE, "SecretNotFound",
                f"spec.authSecretRef: Secret {spec.auth_secret!r} does not exist in this namespace",
            )  # fmt: skip
        if not _secret_keys(secret):
            return Condition(
                "Ready", cond.FALSE, "SecretKeyNotFound",
                f"spec.authSecretRef: Secret {spec.auth_secret!r} has no keys "
                "(add one key per tenant, its token as the value)",
            )  # fmt: skip
    for field, ref in spec.secret_refs():
        secret = await client.get(SECRET, namespace, ref.name)
        if secret is None:
            return Condition(
                "Ready", cond.FALSE, "SecretNotFound",
                f"{field}: Secret {ref.name!r} does not exist in this namespace",
            )  # fmt: skip
        if ref.key not in _secret_keys(secret):
            return Condition(
                "Ready", cond.FALSE, "SecretKeyNotFound",
                f"{field}: Secret {ref.name!r} has no key {ref.key!r}",
            )  # fmt: skip
    return None


async def _check_access(
    client: KubeClient, recipe: ModelRecipe, tier: TierSpec
) -> Condition | None:
    """A ``TierReady`` failure when the engines could not reach the tier: no token for the
    recipe's tenant in the tier's auth Secret, or no client certificate for a tier that
    requires one (the engine pods could not start, or the tier would refuse them)."""
    namespace, cache = recipe.owner.namespace, recipe.cache
    if tier.auth_secret is not None:
        problem = await _check_keys(
            client, namespace, tier.auth_secret, [cache.tenant], "spec.cache.tenant",
            "the tier's auth Secret", "add the tenant's token under that key, or set "
            "spec.cache.tenant to a tenant the Secret has",
        )  # fmt: skip
        if problem is not None:
            return problem
    if tier.tls is None:
        return None
    if cache.client_cert_secret is None:
        if not tier.tls.client_auth:
            return None
        return Condition(
            "TierReady", cond.FALSE, "ClientCertificateRequired",
            "spec.cache.clientCertSecretRef: the tier requires client certificates "
            "(spec.tls.clientAuth); name a kubernetes.io/tls Secret whose certificate the "
            "tier's ca.crt signed",
        )  # fmt: skip
    return await _check_keys(
        client, namespace, cache.client_cert_secret, [TLS_CERT_KEY, TLS_KEY_KEY],
        "spec.cache.clientCertSecretRef", "the client certificate Secret",
        "it needs tls.crt and tls.key (a kubernetes.io/tls Secret)",
    )  # fmt: skip


async def _check_weights(client: KubeClient, recipe: ModelRecipe) -> Condition | None:
    """An ``EngineReady`` failure when the engine pods could not start for want of the
    claims or the hub token Secret that ``spec.model`` names (they would stay Pending)."""
    namespace = recipe.owner.namespace
    for field, claim in recipe.model.claims():
        if await client.get(CLAIM, namespace, claim) is None:
            return Condition(
                "EngineReady", cond.FALSE, "VolumeNotFound",
                f"{field}: PersistentVolumeClaim {claim!r} does not exist in this namespace; "
                "create it, or fix the name",
            )  # fmt: skip
    token = recipe.model.token
    if token is None:
        return None
    return await _check_keys(
        client, namespace, token.name, [token.key], "spec.model.tokenSecretRef",
        "the hub token Secret", "it holds the Hugging Face token (HF_TOKEN) of gated models",
        condition="EngineReady",
    )  # fmt: skip


async def _check_keys(
    client: KubeClient, namespace: str, name: str, keys: Sequence[str], field: str,
    what: str, hint: str, *, condition: str = "TierReady",
) -> Condition | None:  # fmt: skip
    secret = await client.get(SECRET, namespace, name)
    missing = [key for key in keys if secret is None or key not in _secret_keys(secret)]
    if not missing:
        return None
    problem = "does not exist" if secret is None else f"has no key {missing[0]!r}"
    return Condition(
        condition, cond.FALSE, "SecretNotFound" if secret is None else "SecretKeyNotFound",
        f"{field}: {what} {name!r} {problem}; {hint}",
    )  # fmt: skip


async def _certificates_hash(
    client: KubeClient, namespace: str, certificates: Certificates
) -> str | None:
    """A digest of the TLS files a pod mounts, from their Secrets (None without any).
    Servers and connectors read certificates at start: a renewed certificate changes the
    digest, and so the pod template, and the pods roll. Values are hashed, never logged."""
    if not certificates.mounts:
        return None
    digest = hashlib.sha256()
    for name, keys in certificates.secrets():
        secret = await client.get(SECRET, namespace, name)
        data = (secret or {}).get("data") or {}
        for key in keys:
            digest.update(f"{name}\0{key}\0{data.get(key, '')}\0".encode())
    return digest.hexdigest()[:16]


def _secret_keys(secret: Mapping[str, Any]) -> set[str]:
    return set(secret.get("data") or {}) | set(secret.get("stringData") or {})


def _tier_spec(tier_spec: Mapping[str, Any] | None) -> TierSpec | None:
    if tier_spec is None:
        return None
    try:
        return parse_tier_spec(tier_spec, "spec")
    except SpecError:
        return None  # the CacheTier reports its own invalid spec


async def _delete_inline_tier(client: KubeClient, owner: Owner) -> None:
    """Drop the dedicated CacheTier of a recipe that switched from inline to ref."""
    name = owner.name + INLINE_TIER_SUFFIX
    existing = await client.get(CACHE_TIER, owner.namespace, name)
    if existing is not None and _controlled_by(existing, owner):
        logger.info("deleting the inline CacheTier %s/%s", owner.namespace, name)
        await client.delete(CACHE_TIER, owner.namespace, name)


def _status(body: Mapping[str, Any], conditions: Sequence[Condition], **facts: Any) -> Obj:
    """The new status. Facts not known this time are None, which clears stale values."""
    meta = body.get("metadata", {})
    generation = int(meta.get("generation", 0))
    previous = (body.get("status") or {}).get("conditions") or []
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    keys = TIER_FACTS if body.get("kind") == "CacheTier" else RECIPE_FACTS
    assert set(facts) <= set(keys), f"unknown status fields {set(facts) - set(keys)}"
    return {
        "observedGeneration": generation,
        **{key: facts.get(key) for key in keys},
        "conditions": cond.to_status(conditions, previous, generation, now),
    }
