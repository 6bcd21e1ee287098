from __future__ import annotations

from typing import Any

from kvtier.operator.conditions import (
    Condition,
    all_ready,
    engine_ready,
    tier_ready,
    tier_ready_for_recipe,
    to_status,
)


def workload(
    replicas: int, ready: int, *, generation: int = 1, observed: int = 1, **status: Any
) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {"observedGeneration": observed, "updatedReplicas": replicas,
                   "readyReplicas": ready, "availableReplicas": ready, **status},
    }  # fmt: skip


def test_a_tier_is_ready_when_every_statefulset_replica_is_ready() -> None:
    assert tier_ready(workload(2, 2)) == Condition(
        "Ready", "True", "ReplicasReady", "2/2 replicas ready"
    )
    assert tier_ready(workload(2, 1)).reason == "ReplicasNotReady"


def test_a_tier_is_not_ready_until_its_controller_observed_the_current_spec() -> None:
    assert tier_ready(workload(1, 1, generation=2, observed=1)).status == "False"


def test_a_tier_is_rolling_out_while_old_replicas_are_being_replaced() -> None:
    found = tier_ready(workload(2, 2, updatedReplicas=1))
    assert (found.status, found.reason) == ("False", "RollingOut")


def test_an_engine_is_rolling_out_until_every_replica_runs_the_current_template() -> None:
    found = engine_ready(workload(2, 2, generation=3, observed=2))
    assert (found.status, found.reason) == ("False", "RollingOut")


def test_an_engine_scaled_to_zero_counts_as_ready() -> None:
    assert engine_ready(workload(0, 0)).reason == "ScaledToZero"


def test_an_engine_is_ready_when_every_replica_is_available() -> None:
    assert engine_ready(workload(3, 3)).status == "True"
    assert engine_ready(workload(3, 2)).message == "2/3 replicas available"


def test_a_missing_tier_names_the_tier_and_the_field_to_fix() -> None:
    found = tier_ready_for_recipe("shared", None)
    assert (found.status, found.reason) == ("False", "TierNotFound")
    assert "'shared'" in found.message and "spec.tier.ref.name" in found.message


def test_a_tier_that_has_not_reported_its_current_generation_is_pending() -> None:
    tier = {"metadata": {"generation": 2}, "status": {"observedGeneration": 1, "conditions": [
        {"type": "Ready", "status": "True"}]}}  # fmt: skip
    assert tier_ready_for_recipe("shared", tier).reason == "TierPending"


def test_a_not_ready_tier_passes_on_its_reason() -> None:
    tier = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "conditions": [
        {"type": "Ready", "status": "False", "reason": "SecretNotFound", "message": "no secret"}]}}  # fmt: skip
    found = tier_ready_for_recipe("shared", tier)
    assert found.reason == "TierNotReady" and "SecretNotFound: no secret" in found.message


def test_ready_takes_the_first_failing_part() -> None:
    tier = Condition("TierReady", "True", "TierReady", "ok")
    engine = Condition("EngineReady", "False", "ReplicasNotReady", "0/1 replicas available")
    assert all_ready([tier, engine]) == Condition(
        "Ready", "False", "ReplicasNotReady", "0/1 replicas available"
    )
    assert all_ready([tier, tier]).status == "True"


def test_the_transition_time_moves_only_when_the_status_changes() -> None:
    before = [{"type": "Ready", "status": "False", "lastTransitionTime": "T0"}]
    same = to_status([Condition("Ready", "False", "Other", "m")], before, 2, "T1")
    flipped = to_status([Condition("Ready", "True", "Ready", "m")], before, 2, "T1")
    assert same[0]["lastTransitionTime"] == "T0"
    assert flipped[0]["lastTransitionTime"] == "T1"
    assert same[0]["observedGeneration"] == 2
