"""Traffic in the status: chunk hit rate, tokens served and the tier's state, as traffic flows.

A timer (``--traffic-seconds``) reads the ready pods of each resource:

- a ModelRecipe's engine pods' vLLM ``/metrics`` (port 8000): the connector's
  ``kvtier_connector_lookup_chunks_total``, ``..._lookup_hit_chunks_total`` and
  ``..._hit_tokens_total``, summed over the pods that answered, into
  ``status.traffic``, with the CacheTier's ``status.state`` as ``tierState``;
- a CacheTier's pods' ``kvtier server`` ``/metrics`` (port 9400): its Lookup
  counters and each storage tier's health and bytes, into ``status.traffic``, and
  ``status.state`` from the pods' readiness and that health.

Counters are totals over the pods running now (a restarted pod starts again from
zero). What no pod answered is left out, and ``traffic.state`` says how much is
known: ``Known`` (every ready pod answered), ``Partial`` or ``Unknown``, with a
``message`` naming the pods that did not answer and why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.operator.children import ENGINE_PORT, METRICS_PORT, selector
from kvtier.operator.errors import SpecError
from kvtier.operator.kube import kind_of
from kvtier.operator.promtext import Sample, total
from kvtier.operator.reconcile import CACHE_TIER, Context
from kvtier.operator.scrape import Page, PodAddress, ready_pods
from kvtier.operator.spec import Owner, parse_model_recipe, parse_tier_spec

Obj = dict[str, Any]
POD = kind_of("v1", "Pod")

LOOKUP_CHUNKS = "kvtier_connector_lookup_chunks_total"
HIT_CHUNKS = "kvtier_connector_lookup_hit_chunks_total"
HIT_TOKENS = "kvtier_connector_hit_tokens_total"
SERVER_LOOKUP_KEYS = "kvtier_server_lookup_keys_total"
SERVER_HIT_KEYS = "kvtier_server_lookup_hit_keys_total"
SERVER_SERVING = "kvtier_server_serving"
TIER_HEALTHY = "kvtier_tier_healthy"
TIER_USED = "kvtier_tier_used_bytes"
TIER_CAPACITY = "kvtier_tier_capacity_bytes"
SHARED_TIERS = frozenset({"redis"})  # one store below every replica: not summed
STORAGE_ORDER = ("ram", "disk", "redis")
KNOWN, PARTIAL, UNKNOWN = "Known", "Partial", "Unknown"
SERVING, DEGRADED, DOWN = "Serving", "Degraded", "Down"
MAX_NAMED_PODS = 3  # in a message


async def recipe_traffic(ctx: Context, body: Mapping[str, Any]) -> Obj:
    """A ModelRecipe's ``status.traffic``."""
    namespace, _ = _where(body)
    pods = ready_pods(await ctx.client.list(POD, namespace, _selector(body, "engine")))
    pages = await ctx.metrics.read_all(pods, ENGINE_PORT) if ctx.metrics else {}
    tier_state = UNKNOWN
    tier_name = _tier_name(body)
    if tier_name is not None:
        tier = await ctx.client.get(CACHE_TIER, namespace, tier_name)
        tier_state = str(((tier or {}).get("status") or {}).get("state") or UNKNOWN)
    return {"traffic": engine_summary(pods, pages, tier_state)}


async def tier_traffic(ctx: Context, body: Mapping[str, Any]) -> Obj:
    """A CacheTier's ``status.state`` and ``status.traffic``."""
    namespace, _ = _where(body)
    pods = ready_pods(await ctx.client.list(POD, namespace, _selector(body, "cache-tier")))
    metrics = _metrics_enabled(body)
    pages = await ctx.metrics.read_all(pods, METRICS_PORT) if ctx.metrics and metrics else {}
    desired = int((body.get("status") or {}).get("replicas") or 0)
    state, traffic = tier_summary(desired, pods, pages, metrics=metrics)
    return {"state": state, "traffic": traffic}


def engine_summary(pods: Sequence[PodAddress], pages: Mapping[str, Page], tier_state: str) -> Obj:
    """``status.traffic`` of a recipe from its ready engine pods' pages."""
    reporting: dict[str, list[Sample]] = {}
    problems: dict[str, str] = {}
    for pod in pods:
        page = pages.get(pod.name, "not read")
        if isinstance(page, str):
            problems[pod.name] = page
        elif total(page, LOOKUP_CHUNKS) is None:
            problems[pod.name] = "no kvtier connector series (is the connector configured?)"
        else:
            reporting[pod.name] = page
    lookups = _sum(reporting.values(), LOOKUP_CHUNKS)
    hits = _sum(reporting.values(), HIT_CHUNKS)
    return {
        "state": _knowledge(len(pods), len(reporting)),
        "engines": len(pods),
        "enginesReporting": len(reporting),
        "lookupChunks": lookups,
        "hitChunks": hits,
        "chunkHitRate": _rate(hits, lookups),
        "tokensServed": _sum(reporting.values(), HIT_TOKENS),
        "tierState": tier_state,
        "message": _message(pods, problems, "engine"),
    }


def tier_summary(
    desired: int, pods: Sequence[PodAddress], pages: Mapping[str, Page], *, metrics: bool
) -> tuple[str, Obj]:
    """(``status.state``, ``status.traffic``) of a tier from its ready pods' pages."""
    reporting: dict[str, list[Sample]] = {}
    problems: dict[str, str] = {}
    for pod in pods:
        page = pages.get(pod.name, "not read")
        if isinstance(page, str):
            problems[pod.name] = page
        elif total(page, SERVER_LOOKUP_KEYS) is None:
            problems[pod.name] = "no kvtier_server series"
        else:
            reporting[pod.name] = page
    storage = _storage(list(reporting.values()))
    draining = any(total(page, SERVER_SERVING) == 0 for page in reporting.values())
    unhealthy = [layer["tier"] for layer in storage if layer["healthy"] is False]
    if not pods:
        state = DOWN if desired else UNKNOWN
    elif len(pods) < desired or unhealthy or draining:
        state = DEGRADED
    else:
        state = SERVING
    lookups = _sum(reporting.values(), SERVER_LOOKUP_KEYS)
    hits = _sum(reporting.values(), SERVER_HIT_KEYS)
    notes = [f"{len(pods)}/{desired} replicas ready"]
    if unhealthy:
        notes.append("failing: " + ", ".join(unhealthy))
    if draining:
        notes.append("a replica is draining")
    if not metrics:
        notes.append("metrics are off (spec.metrics.enabled): storage health unknown")
    elif problems:
        notes.append(str(_message(pods, problems, "replica")))
    traffic = {
        "state": _knowledge(len(pods), len(reporting)) if metrics else UNKNOWN,
        "replicasReporting": len(reporting),
        "lookupChunks": lookups,
        "hitChunks": hits,
        "chunkHitRate": _rate(hits, lookups),
        "storage": storage or None,
        "message": "; ".join(notes),
    }
    return state, traffic


def _storage(pages: Sequence[list[Sample]]) -> list[Obj]:
    """Each storage tier's health and bytes: a tier is healthy when every replica says so;
    bytes are summed over replicas, except a store they share (Redis)."""
    layers: dict[str, Obj] = {}
    for page in pages:
        for sample in page:
            tier = sample.labels.get("tier")
            if tier is None or sample.name not in (TIER_HEALTHY, TIER_USED, TIER_CAPACITY):
                continue
            layer = layers.setdefault(tier, {"tier": tier, "healthy": True})
            if sample.name == TIER_HEALTHY:
                layer["healthy"] = layer["healthy"] and sample.value == 1
                continue
            key = "usedBytes" if sample.name == TIER_USED else "capacityBytes"
            value = int(sample.value)
            before = layer.get(key, 0)
            layer[key] = max(before, value) if tier in SHARED_TIERS else before + value
    order = {name: i for i, name in enumerate(STORAGE_ORDER)}
    return sorted(layers.values(), key=lambda layer: (order.get(layer["tier"], 99), layer["tier"]))


def _sum(pages: Any, name: str) -> int | None:
    values = [value for page in pages if (value := total(page, name)) is not None]
    return int(sum(values)) if values else None


def _rate(hits: int | None, lookups: int | None) -> float | None:
    if not lookups or hits is None:
        return None
    return round(hits / lookups, 4)


def _knowledge(ready: int, reporting: int) -> str:
    if ready and reporting == ready:
        return KNOWN
    return PARTIAL if reporting else UNKNOWN


def _message(pods: Sequence[PodAddress], problems: Mapping[str, str], what: str) -> str | None:
    if not pods:
        return f"no ready {what} pods"
    if not problems:
        return None
    named = [f"{name}: {why}" for name, why in sorted(problems.items())[:MAX_NAMED_PODS]]
    more = len(problems) - len(named)
    return (
        f"metrics of {len(problems)}/{len(pods)} {what} pods unknown ("
        + "; ".join(named)
        + (f"; and {more} more" if more else "")
        + ")"
    )


def _where(body: Mapping[str, Any]) -> tuple[str, str]:
    meta = body.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


def _selector(body: Mapping[str, Any], component: str) -> str:
    namespace, name = _where(body)
    owner = Owner(str(body.get("kind", "")), name, namespace, "", 0)
    return ",".join(f"{key}={value}" for key, value in selector(owner, component).items())


def _tier_name(body: Mapping[str, Any]) -> str | None:
    try:
        return parse_model_recipe(body).tier_name
    except SpecError:
        return None


def _metrics_enabled(body: Mapping[str, Any]) -> bool:
    try:
        return parse_tier_spec(body.get("spec") or {}, "spec").metrics
    except SpecError:
        return False
