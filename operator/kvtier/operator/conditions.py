"""Status conditions, computed from the observed objects: pure functions.

CacheTier: ``Ready``. ModelRecipe: ``TierReady``, ``EngineReady`` and ``Ready``
(both of the others). Readiness comes from the children's status fields, which
Kubernetes' controllers keep: a StatefulSet's ``readyReplicas``, a
Deployment's ``availableReplicas``, both only once their ``observedGeneration``
caught up with the spec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str

    @property
    def is_true(self) -> bool:
        return self.status == TRUE


def rollout(obj: Mapping[str, Any] | None, ready_field: str) -> tuple[int, int, bool]:
    """(desired, ready, settled) replicas of a StatefulSet or Deployment.

    ``settled`` is true once its controller has seen the current spec and every
    replica runs the current template.
    """
    if obj is None:
        return 0, 0, False
    desired = int(obj.get("spec", {}).get("replicas", 1))
    status = obj.get("status") or {}
    generation = obj.get("metadata", {}).get("generation", 0)
    observed = status.get("observedGeneration", 0) >= generation
    updated = status.get("updatedReplicas", 0) >= desired
    return desired, int(status.get(ready_field, 0)), observed and updated


def tier_ready(statefulset: Mapping[str, Any] | None) -> Condition:
    """``Ready`` of a CacheTier, from its StatefulSet."""
    desired, ready, settled = rollout(statefulset, "readyReplicas")
    if statefulset is None:
        return Condition(
            "Ready", FALSE, "StatefulSetMissing", "the tier's StatefulSet is not there yet"
        )
    if ready >= desired and settled:
        return Condition("Ready", TRUE, "ReplicasReady", f"{ready}/{desired} replicas ready")
    if ready >= desired:
        return Condition("Ready", FALSE, "RollingOut", "replacing replicas with the current spec")
    return Condition("Ready", FALSE, "ReplicasNotReady", f"{ready}/{desired} replicas ready")


def daemonset_rollout(obj: Mapping[str, Any] | None) -> tuple[int, int, bool]:
    """(desired, ready, settled) pods of a DaemonSet: one per node it runs on."""
    if obj is None:
        return 0, 0, False
    status = obj.get("status") or {}
    desired = int(status.get("desiredNumberScheduled", 0))
    observed = status.get("observedGeneration", 0) >= obj.get("metadata", {}).get("generation", 0)
    updated = status.get("updatedNumberScheduled", 0) >= desired
    return desired, int(status.get("numberReady", 0)), observed and updated


def per_node_tier_ready(daemonset: Mapping[str, Any] | None) -> Condition:
    """``Ready`` of a per-node CacheTier, from its DaemonSet."""
    desired, ready, settled = daemonset_rollout(daemonset)
    if daemonset is None:
        return Condition("Ready", FALSE, "DaemonSetMissing", "the tier's DaemonSet is not there yet")
    if not settled:
        return Condition("Ready", FALSE, "RollingOut", "replacing pods with the current spec")
    if desired == 0:
        return Condition(
            "Ready", FALSE, "NoNodes",
            "no node runs a tier pod: check spec.nodeSelector and spec.tolerations against the "
            "nodes that run engines",
        )  # fmt: skip
    if ready >= desired:
        return Condition("Ready", TRUE, "ReplicasReady", f"{ready}/{desired} nodes ready")
    return Condition("Ready", FALSE, "ReplicasNotReady", f"{ready}/{desired} nodes ready")


def engine_ready(deployment: Mapping[str, Any] | None) -> Condition:
    """``EngineReady`` of a ModelRecipe, from its Deployment."""
    desired, available, settled = rollout(deployment, "availableReplicas")
    if deployment is None:
        return Condition(
            "EngineReady", FALSE, "DeploymentMissing", "the engine's Deployment is not there yet"
        )
    if desired == 0:
        return Condition("EngineReady", TRUE, "ScaledToZero", "spec.engine.replicas is 0")
    if available >= desired and settled:
        return Condition(
            "EngineReady", TRUE, "ReplicasAvailable", f"{available}/{desired} replicas available"
        )
    if available >= desired:
        return Condition(
            "EngineReady", FALSE, "RollingOut", "replacing replicas with the current spec"
        )
    return Condition(
        "EngineReady", FALSE, "ReplicasNotReady", f"{available}/{desired} replicas available"
    )


def tier_ready_for_recipe(tier_name: str, cache_tier: Mapping[str, Any] | None) -> Condition:
    """``TierReady`` of a ModelRecipe, from the CacheTier it uses (its ``Ready`` condition)."""
    if cache_tier is None:
        return Condition(
            "TierReady", FALSE, "TierNotFound",
            f"CacheTier {tier_name!r} does not exist in this namespace: create it or fix spec.tier.ref.name",
        )  # fmt: skip
    status = cache_tier.get("status") or {}
    generation = cache_tier.get("metadata", {}).get("generation", 0)
    ready = find(status.get("conditions") or [], "Ready")
    if ready is None or status.get("observedGeneration", 0) < generation:
        return Condition(
            "TierReady", FALSE, "TierPending", f"CacheTier {tier_name!r} has not reported yet"
        )
    if ready.get("status") != TRUE:
        reason = ready.get("reason", "NotReady")
        return Condition(
            "TierReady", FALSE, "TierNotReady",
            f"CacheTier {tier_name!r} is not ready ({reason}: {ready.get('message', '')})",
        )  # fmt: skip
    return Condition("TierReady", TRUE, "TierReady", f"CacheTier {tier_name!r} is ready")


def all_ready(parts: Sequence[Condition]) -> Condition:
    """``Ready``: true when every part is; otherwise the first part that is not."""
    for part in parts:
        if not part.is_true:
            return Condition("Ready", part.status, part.reason, part.message)
    return Condition("Ready", TRUE, "Ready", "; ".join(part.message for part in parts))


def failed(types: Sequence[str], reason: str, message: str) -> list[Condition]:
    """The same failure in every condition (an invalid spec: nothing was reconciled)."""
    return [Condition(type_, FALSE, reason, message) for type_ in types]


def to_status(
    conditions: Sequence[Condition],
    previous: Sequence[Mapping[str, Any]],
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """Conditions as status dicts; ``lastTransitionTime`` moves only when the status changes."""
    out = []
    for condition in conditions:
        before = find(previous, condition.type)
        changed = before is None or before.get("status") != condition.status
        out.append({
            "type": condition.type,
            "status": condition.status,
            "reason": condition.reason,
            "message": condition.message,
            "observedGeneration": generation,
            "lastTransitionTime": now if changed or before is None else before.get("lastTransitionTime", now),
        })  # fmt: skip
    return out


def find(conditions: Sequence[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)
