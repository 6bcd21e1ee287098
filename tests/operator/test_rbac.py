from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvtier.operator.children import ClusterFeatures, cache_tier_children, model_recipe_children
from kvtier.operator.kube import kind_for
from kvtier.operator.reconcile import CREATE_ONCE
from kvtier.operator.spec import parse_cache_tier, parse_model_recipe
from tests.operator.bodies import cache_tier, model_recipe

RBAC = yaml.safe_load((Path(__file__).resolve().parents[2] / "operator" / "kvtier" / "operator" / "rbac.yaml").read_text())


def allowed(group: str, resource: str) -> set[str]:
    verbs: set[str] = set()
    for rule in RBAC["rules"]:
        if group in rule["apiGroups"] and resource in rule["resources"]:
            verbs |= set(rule["verbs"])
    return verbs


def test_the_cluster_role_has_no_wildcards() -> None:
    for rule in RBAC["rules"]:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], rule


def test_the_operator_may_apply_every_kind_of_child_it_makes() -> None:
    model = {
        "repo": "google/gemma-3-4b-it", "architecture": "Gemma3ForConditionalGeneration",
        "cache": {"size": "100Gi"},
    }  # fmt: skip
    recipe = model_recipe(tier={"inline": {}}, model=model)
    per_node = cache_tier(topology="perNode", redis={"url": "redis://redis:6379/0"})
    children: list[dict[str, Any]] = [
        *cache_tier_children(parse_cache_tier(cache_tier()), "img", ClusterFeatures()),
        *cache_tier_children(parse_cache_tier(per_node), "img", ClusterFeatures()),
        *model_recipe_children(parse_model_recipe(recipe), None),
    ]
    assert {"PersistentVolumeClaim", "DaemonSet"} <= {child["kind"] for child in children}
    for child in children:
        group = child["apiVersion"].rpartition("/")[0]
        # Kinds created once and left alone need no patch.
        needed = {"get", "create"} | (set() if child["kind"] in CREATE_ONCE else {"patch"})
        assert needed <= allowed(group, kind_for(child).plural), child["kind"]


def test_claims_are_read_and_created_never_changed_listed_or_deleted() -> None:
    assert allowed("", "persistentvolumeclaims") == {"get", "create"}


def test_the_operator_may_not_list_or_delete_its_children() -> None:
    for group, resource in (("", "configmaps"), ("", "services"), ("apps", "deployments")):
        assert allowed(group, resource).isdisjoint({"list", "watch", "delete", "update"})


def test_secrets_are_only_read_one_by_one() -> None:
    assert allowed("", "secrets") == {"get"}
