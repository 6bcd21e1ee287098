"""Acceptance: the operator against a real kube-apiserver and kube-controller-manager (1.20.2).

No kubelet runs: pods stay Pending unless a test marks them Ready the way a
kubelet would (``mark_pods_ready``), which drives the StatefulSet and
Deployment controllers' status fields, which drive the operator's conditions.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from kvtier.operator.errors import Invalid
from kvtier.operator.kube import KubeClient
from tests.operator.cluster import (
    CACHE_TIER,
    CLAIM,
    CONFIGMAP,
    DAEMONSET,
    DEPLOYMENT,
    EVENT,
    MODEL_RECIPE,
    SECRET,
    SERVICE,
    STATEFULSET,
    condition,
    eventually,
    mark_pods_ready,
    wait_for_condition,
)
from tests.operator.conftest import OperatorProcess

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("operator")]

ENGINE_IMAGE = "vllm/vllm-openai:test"


def cache_tier(namespace: str, name: str = "shared", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "CacheTier",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def model_recipe(namespace: str, name: str = "qwen", **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {
            "repo": "Qwen/Qwen2.5-VL-3B-Instruct",
            "architecture": "Qwen2_5_VLForConditionalGeneration",
            "modalities": ["text", "image"],
        },
        "engine": {"image": ENGINE_IMAGE, "gpus": 0},
        "tier": {"ref": {"name": "shared"}},
        **overrides,
    }
    return {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "ModelRecipe",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


async def test_crds_print_model_tier_ready_and_age_columns(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(model_recipe(namespace))
    await wait_for_condition(kube, namespace, "ModelRecipe", "qwen", "Ready")
    table = await kube.request(
        "GET", MODEL_RECIPE.path(namespace), accept="application/json;as=Table;v=v1;g=meta.k8s.io"
    )
    columns = [column["name"] for column in table["columnDefinitions"]]
    assert columns == ["Name", "Model", "Tier", "Ready", "Reason", "Hit Rate", "Age"]
    (row,) = table["rows"]
    assert row["cells"][:4] == ["qwen", "Qwen/Qwen2.5-VL-3B-Instruct", "shared", "False"]


async def test_a_cache_tier_gets_its_statefulset_services_and_settings(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(cache_tier(namespace, ramBytes="1Gi", disk={"size": "10Gi"}))
    await wait_for_condition(kube, namespace, "CacheTier", "shared", "Ready")
    statefulset = await kube.get(STATEFULSET, namespace, "shared")
    assert statefulset is not None
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["kvtier-server"]
    assert container["image"] == "kvtier:test"
    claim = statefulset["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["resources"]["requests"]["storage"] == "10Gi"
    settings = await kube.get(CONFIGMAP, namespace, "shared-settings")
    assert settings is not None
    assert settings["data"]["KVTIER_RAM_BYTES"] == str(2**30)
    assert settings["data"]["KVTIER_DISK_BYTES"] == str(int(10 * 2**30 * 0.9))
    headless = await kube.get(SERVICE, namespace, "shared-headless")
    client = await kube.get(SERVICE, namespace, "shared")
    assert headless is not None and headless["spec"]["clusterIP"] == "None"
    assert client is not None and {p["port"] for p in client["spec"]["ports"]} == {
        50051,
        50052,
        9400,
    }
    assert client["spec"]["sessionAffinity"] == "ClientIP"  # one replica per engine pod
    tier = await kube.get(CACHE_TIER, namespace, "shared")
    assert tier is not None
    for child in (statefulset, settings, headless, client):
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "CacheTier",
            tier["metadata"]["uid"],
            True,
        )


async def test_a_cache_tier_turns_ready_when_its_pods_are_ready(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(cache_tier(namespace))
    tier = await wait_for_condition(kube, namespace, "CacheTier", "shared", "Ready", status="False")
    assert condition(tier, "Ready")["reason"] == "ReplicasNotReady"
    assert tier["status"]["endpoint"] == f"shared.{namespace}.svc:50051"
    assert await mark_pods_ready(kube, namespace, "app.kubernetes.io/instance=shared") == 1
    tier = await wait_for_condition(kube, namespace, "CacheTier", "shared", "Ready", status="True")
    assert tier["status"]["readyReplicas"] == 1


async def test_a_recipe_gets_a_vllm_deployment_wired_to_the_tier_service(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(cache_tier(namespace))
    await kube.create(model_recipe(namespace, cache={"chunkSize": 512, "encoderCache": True}))
    await wait_for_condition(kube, namespace, "ModelRecipe", "qwen", "Ready")
    deployment = await kube.get(DEPLOYMENT, namespace, "qwen")
    assert deployment is not None
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    args = container["args"]
    assert args[args.index("--kv-transfer-config") + 1] == "$(KVTIER_KV_TRANSFER_CONFIG)"
    assert args[args.index("--ec-transfer-config") + 1] == "$(KVTIER_EC_TRANSFER_CONFIG)"
    config = await kube.get(CONFIGMAP, namespace, "qwen-kvtier")
    assert config is not None
    kv = json.loads(config["data"]["kv-transfer-config.json"])
    assert kv["kv_connector"] == "KvtierConnector"
    assert kv["kv_connector_extra_config"]["target"] == f"shared.{namespace}.svc:50051"
    assert kv["kv_connector_extra_config"]["chunk_size"] == 512
    ec = json.loads(config["data"]["ec-transfer-config.json"])
    assert ec["ec_connector"] == "KvtierECConnector"
    service = await kube.get(SERVICE, namespace, "qwen")
    assert service is not None and service["spec"]["ports"][0]["port"] == 8000


async def test_a_recipe_reports_each_condition_with_its_reason_and_the_observed_generation(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(cache_tier(namespace))
    await kube.create(model_recipe(namespace))
    recipe = await wait_for_condition(
        kube, namespace, "ModelRecipe", "qwen", "EngineReady", status="False", generation=1
    )
    assert condition(recipe, "TierReady")["reason"] in ("TierPending", "TierNotReady")
    assert condition(recipe, "EngineReady")["reason"] == "ReplicasNotReady"
    assert condition(recipe, "Ready")["status"] == "False"
    assert recipe["status"]["tierEndpoint"] == f"shared.{namespace}.svc:50051"
    assert recipe["status"]["endpoint"] == f"qwen.{namespace}.svc:8000"


async def test_a_recipe_turns_ready_when_tier_and_engine_pods_are_ready(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(cache_tier(namespace))
    await kube.create(model_recipe(namespace))
    await mark_pods_ready(kube, namespace, "app.kubernetes.io/instance=shared")
    await mark_pods_ready(kube, namespace, "app.kubernetes.io/instance=qwen")
    recipe = await wait_for_condition(
        kube, namespace, "ModelRecipe", "qwen", "Ready", status="True"
    )
    assert condition(recipe, "TierReady")["status"] == "True"
    assert condition(recipe, "EngineReady")["reason"] == "ReplicasAvailable"
    assert recipe["status"]["availableReplicas"] == 1


async def test_editing_a_recipe_rolls_out_a_new_engine_template(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(cache_tier(namespace))
    await kube.create(model_recipe(namespace))
    before = await eventually(lambda: kube.get(DEPLOYMENT, namespace, "qwen"))
    await kube.patch(MODEL_RECIPE, namespace, "qwen", {
        "spec": {"engine": {"args": ["--max-model-len", "4096"]}, "cache": {"chunkSize": 128}}
    })  # fmt: skip

    async def rolled_out() -> dict[str, Any] | None:
        after = await kube.get(DEPLOYMENT, namespace, "qwen")
        changed = after and after["metadata"]["generation"] > before["metadata"]["generation"]
        return after if changed else None

    after = await eventually(rolled_out, what="a new Deployment generation")
    (container,) = after["spec"]["template"]["spec"]["containers"]
    assert container["args"][-2:] == ["--max-model-len", "4096"]
    hashes = [
        d["spec"]["template"]["metadata"]["annotations"]["kvtier.io/settings-hash"]
        for d in (before, after)
    ]
    assert hashes[0] != hashes[1], "a new kv-transfer-config restarts the engines"
    await wait_for_condition(kube, namespace, "ModelRecipe", "qwen", "Ready", generation=2)


async def test_a_deleted_child_is_restored(kube: KubeClient, namespace: str) -> None:
    await kube.create(cache_tier(namespace))
    await kube.create(model_recipe(namespace))
    first = await eventually(lambda: kube.get(DEPLOYMENT, namespace, "qwen"))
    await kube.delete(DEPLOYMENT, namespace, "qwen")

    async def recreated() -> dict[str, Any] | None:
        again = await kube.get(DEPLOYMENT, namespace, "qwen")
        return again if again and again["metadata"]["uid"] != first["metadata"]["uid"] else None

    await eventually(recreated, what="the Deployment to come back")
    await kube.delete(SERVICE, namespace, "shared")
    await eventually(
        lambda: kube.get(SERVICE, namespace, "shared"), what="the tier's Service to come back"
    )


async def test_an_edited_child_is_set_back(kube: KubeClient, namespace: str) -> None:
    await kube.create(cache_tier(namespace, replicas=2))
    await eventually(lambda: kube.get(STATEFULSET, namespace, "shared"))
    await kube.patch(STATEFULSET, namespace, "shared", {"spec": {"replicas": 5}})

    async def reverted() -> bool:
        statefulset = await kube.get(STATEFULSET, namespace, "shared")
        return statefulset is not None and statefulset["spec"]["replicas"] == 2

    await eventually(reverted, what="spec.replicas back to 2")


async def test_an_unsupported_engine_is_rejected_by_the_api_server(
    kube: KubeClient, namespace: str
) -> None:
    recipe = model_recipe(namespace, engine={"image": ENGINE_IMAGE, "kind": "sglang"})
    with pytest.raises(
        Invalid,
        match=re.escape('spec.engine.kind: Unsupported value: "sglang": supported values: "vllm"'),
    ):
        await kube.create(recipe)


async def test_a_recipe_with_both_tier_ref_and_inline_is_rejected_by_the_api_server(
    kube: KubeClient, namespace: str
) -> None:
    recipe = model_recipe(namespace, tier={"ref": {"name": "shared"}, "inline": {}})
    with pytest.raises(Invalid, match=r"spec\.tier"):
        await kube.create(recipe)


async def test_a_recipe_naming_a_missing_tier_says_so_until_the_tier_exists(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(model_recipe(namespace, tier={"ref": {"name": "nope"}}))
    recipe = await wait_for_condition(
        kube, namespace, "ModelRecipe", "qwen", "TierReady", reason="TierNotFound"
    )
    assert "'nope' does not exist" in condition(recipe, "TierReady")["message"]
    assert condition(recipe, "Ready")["reason"] == "TierNotFound"
    await kube.create(cache_tier(namespace, name="nope"))
    await wait_for_condition(
        kube, namespace, "ModelRecipe", "qwen", "TierReady", reason="TierNotReady"
    )


async def test_a_tier_naming_a_missing_secret_says_so_until_the_secret_exists(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(cache_tier(namespace, authSecretRef={"name": "tier-auth"}))
    tier = await wait_for_condition(
        kube, namespace, "CacheTier", "shared", "Ready", reason="SecretNotFound"
    )
    assert (
        "spec.authSecretRef: Secret 'tier-auth' does not exist"
        in condition(tier, "Ready")["message"]
    )
    await kube.create({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "tier-auth", "namespace": namespace},
        "stringData": {"default": "s3cret-token-of-the-default-tenant"},
    })  # fmt: skip
    await wait_for_condition(
        kube, namespace, "CacheTier", "shared", "Ready", reason="ReplicasNotReady"
    )
    assert await kube.get(SECRET, namespace, "tier-auth") is not None


async def test_a_recipe_whose_tenant_has_no_token_in_the_tiers_secret_says_so_until_it_has(
    kube: KubeClient, namespace: str
) -> None:
    secret = {
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "tier-auth", "namespace": namespace},
        "stringData": {"team-a": "a-token-of-the-team-a-tenant"},
    }  # fmt: skip
    await kube.create(secret)
    await kube.create(cache_tier(namespace, authSecretRef={"name": "tier-auth"}))
    await kube.create(model_recipe(namespace, cache={"tenant": "team-b"}))
    recipe = await wait_for_condition(
        kube, namespace, "ModelRecipe", "qwen", "TierReady", reason="SecretKeyNotFound"
    )
    message = condition(recipe, "TierReady")["message"]
    assert "spec.cache.tenant" in message and "'team-b'" in message
    deployment = await kube.get(DEPLOYMENT, namespace, "qwen")
    assert deployment is not None
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    token = next(v for v in volumes if v["name"] == "kvtier-auth")
    assert token["secret"]["items"] == [{"key": "team-b", "path": "token"}]
    secret["stringData"]["team-b"] = "a-token-of-the-team-b-tenant"
    await kube.apply(secret)
    await wait_for_condition(
        kube, namespace, "ModelRecipe", "qwen", "TierReady", reason="TierNotReady"
    )


async def test_a_mutual_tls_tier_and_its_recipes_say_which_certificate_is_missing_until_it_exists(
    kube: KubeClient, namespace: str
) -> None:
    def tls_secret(name: str, **data: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": name, "namespace": namespace}, "stringData": data,
        }  # fmt: skip

    pem = {"tls.crt": "certificate", "tls.key": "key"}
    tier_tls = tls_secret("tier-tls", **pem)  # no ca.crt yet
    await kube.create(tier_tls)
    await kube.create(cache_tier(namespace, tls={"secretName": "tier-tls", "clientAuth": True}))
    tier = await wait_for_condition(
        kube, namespace, "CacheTier", "shared", "Ready", reason="SecretKeyNotFound"
    )
    assert (
        "spec.tls.secretName: Secret 'tier-tls' has no key 'ca.crt'"
        in (condition(tier, "Ready")["message"])
    )
    await kube.apply(tls_secret("tier-tls", **pem, **{"ca.crt": "ca"}))
    await wait_for_condition(
        kube, namespace, "CacheTier", "shared", "Ready", reason="ReplicasNotReady"
    )
    await kube.create(model_recipe(namespace))
    recipe = await wait_for_condition(
        kube, namespace, "ModelRecipe", "qwen", "TierReady", reason="ClientCertificateRequired"
    )
    assert "spec.cache.clientCertSecretRef" in condition(recipe, "TierReady")["message"]
    await kube.create(tls_secret("engine-tls", **pem))
    await kube.patch(
        MODEL_RECIPE,
        namespace,
        "qwen",
        {"spec": {"cache": {"clientCertSecretRef": {"name": "engine-tls"}}}},
    )
    await wait_for_condition(
        kube, namespace, "ModelRecipe", "qwen", "TierReady", reason="TierNotReady"
    )
    deployment = await kube.get(DEPLOYMENT, namespace, "qwen")
    assert deployment is not None
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["kvtier-tls"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    assert volumes["kvtier-client-tls"]["secret"]["secretName"] == "engine-tls"
    statefulset = await kube.get(STATEFULSET, namespace, "shared")
    assert statefulset is not None
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert "tcpSocket" in container["readinessProbe"]


async def test_a_renewed_certificate_rolls_the_tier_and_a_new_ca_the_engines(
    kube: KubeClient, namespace: str
) -> None:
    def tls_secret(**data: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": "tier-tls", "namespace": namespace}, "stringData": data,
        }  # fmt: skip

    await kube.create(tls_secret(**{"tls.crt": "cert 1", "tls.key": "key 1", "ca.crt": "ca 1"}))
    await kube.create(cache_tier(namespace, tls={"secretName": "tier-tls"}))
    await kube.create(model_recipe(namespace))
    await wait_for_condition(kube, namespace, "ModelRecipe", "qwen", "TierReady")

    async def template_hash(kind: Any, name: str) -> str:
        obj = await kube.get(kind, namespace, name)
        assert obj is not None
        return str(
            obj["spec"]["template"]["metadata"]["annotations"]["kvtier.io/certificates-hash"]
        )

    tier_before = await template_hash(STATEFULSET, "shared")
    engine_before = await template_hash(DEPLOYMENT, "qwen")

    async def changed(kind: Any, name: str, before: str) -> bool:
        return await template_hash(kind, name) != before

    # A renewal (new certificate and key, same CA): the tier rolls, the engines keep running.
    await kube.apply(tls_secret(**{"tls.crt": "cert 2", "tls.key": "key 2", "ca.crt": "ca 1"}))
    await eventually(
        lambda: changed(STATEFULSET, "shared", tier_before), what="a new tier template"
    )
    assert await template_hash(DEPLOYMENT, "qwen") == engine_before
    # A new CA: the engines, which verify the tier with it, roll too.
    await kube.apply(tls_secret(**{"tls.crt": "cert 3", "tls.key": "key 3", "ca.crt": "ca 2"}))
    await eventually(
        lambda: changed(DEPLOYMENT, "qwen", engine_before), what="a new engine template"
    )


async def test_an_invalid_combination_is_reported_in_status_without_children(
    kube: KubeClient, namespace: str
) -> None:
    text_model = {"repo": "Qwen/Qwen2-0.5B", "architecture": "Qwen2ForCausalLM"}
    await kube.create(model_recipe(namespace, model=text_model, cache={"encoderCache": True}))
    recipe = await wait_for_condition(
        kube, namespace, "ModelRecipe", "qwen", "Ready", reason="InvalidSpec"
    )
    assert "spec.cache.encoderCache" in condition(recipe, "Ready")["message"]
    assert await kube.get(DEPLOYMENT, namespace, "qwen") is None


async def test_an_invalid_spec_is_posted_once_as_a_warning_event(
    kube: KubeClient, namespace: str
) -> None:
    text_model = {"repo": "Qwen/Qwen2-0.5B", "architecture": "Qwen2ForCausalLM"}
    await kube.create(model_recipe(namespace, model=text_model, cache={"encoderCache": True}))

    async def warnings() -> list[dict[str, Any]]:
        events = await kube.list(EVENT, namespace)
        return [e for e in events if e["type"] == "Warning" and e["reason"] == "InvalidSpec"]

    (event,) = await eventually(warnings, what="a warning event")
    assert event["involvedObject"]["name"] == "qwen"
    assert "spec.cache.encoderCache" in event["message"]
    await asyncio.sleep(2.5)  # two more resyncs
    assert len(await warnings()) == 1


async def test_a_child_name_taken_by_a_foreign_object_is_reported_not_taken_over(
    kube: KubeClient, namespace: str
) -> None:
    foreign = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "shared-settings", "namespace": namespace},
    }
    await kube.create({**foreign, "data": {"mine": "yes"}})
    await kube.create(cache_tier(namespace))
    tier = await wait_for_condition(
        kube, namespace, "CacheTier", "shared", "Ready", reason="ChildConflict"
    )
    assert "ConfigMap named 'shared-settings'" in condition(tier, "Ready")["message"]
    config = await kube.get(CONFIGMAP, namespace, "shared-settings")
    assert config is not None and config["data"] == {"mine": "yes"}


async def test_deleting_a_recipe_removes_its_children_and_its_inline_tier(
    kube: KubeClient, namespace: str
) -> None:
    inline = {"ramBytes": "1Gi", "disk": {"enabled": False}}
    await kube.create(model_recipe(namespace, tier={"inline": inline}))
    await wait_for_condition(kube, namespace, "CacheTier", "qwen-tier", "Ready")
    statefulset = await eventually(lambda: kube.get(STATEFULSET, namespace, "qwen-tier"))
    assert "volumeClaimTemplates" not in statefulset["spec"]
    await eventually(lambda: kube.get(DEPLOYMENT, namespace, "qwen"))
    await kube.delete(MODEL_RECIPE, namespace, "qwen")
    children = [
        (DEPLOYMENT, "qwen"), (SERVICE, "qwen"), (CONFIGMAP, "qwen-kvtier"),
        (CACHE_TIER, "qwen-tier"), (STATEFULSET, "qwen-tier"), (SERVICE, "qwen-tier"),
    ]  # fmt: skip

    async def all_gone() -> bool:
        return all([await kube.get(kind, namespace, name) is None for kind, name in children])

    # The garbage collector works in passes (and learns new kinds every 30 s): on a loaded
    # 2-core machine two cascades (recipe -> tier -> StatefulSet) took over 60 s.
    await eventually(all_gone, within=180, what="the garbage collector to remove every child")


def test_the_operator_needed_no_permission_beyond_rbac_yaml(operator: OperatorProcess) -> None:
    log = operator.log_text()
    assert "Forbidden" not in log and " 403" not in log, log[-3000:]


async def test_a_new_disk_size_replaces_the_statefulset_keeping_its_pods(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(cache_tier(namespace, disk={"size": "10Gi"}))
    await wait_for_condition(kube, namespace, "CacheTier", "shared", "Ready", generation=1)
    first = await kube.get(STATEFULSET, namespace, "shared")
    assert first is not None
    await kube.patch(CACHE_TIER, namespace, "shared", {"spec": {"disk": {"size": "30Gi"}}})

    async def replaced() -> dict[str, Any] | None:
        again = await kube.get(STATEFULSET, namespace, "shared")
        return again if again and again["metadata"]["uid"] != first["metadata"]["uid"] else None

    statefulset = await eventually(replaced, what="a new StatefulSet")
    claim = statefulset["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["resources"]["requests"]["storage"] == "30Gi"
    tier = await wait_for_condition(kube, namespace, "CacheTier", "shared", "Ready", generation=2)
    assert condition(tier, "Ready")["reason"] == "ReplicasNotReady"


async def test_switching_a_recipe_from_inline_to_ref_drops_its_dedicated_tier(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(cache_tier(namespace))
    await kube.create(model_recipe(namespace, tier={"inline": {"disk": {"enabled": False}}}))
    await wait_for_condition(kube, namespace, "CacheTier", "qwen-tier", "Ready")
    await kube.request(
        "PATCH", MODEL_RECIPE.path(namespace, "qwen"),
        body=[{"op": "replace", "path": "/spec/tier", "value": {"ref": {"name": "shared"}}}],
        content_type="application/json-patch+json",
    )  # fmt: skip
    recipe = await wait_for_condition(kube, namespace, "ModelRecipe", "qwen", "Ready", generation=2)
    assert recipe["status"]["tier"] == "shared"

    async def dropped() -> bool:
        return await kube.get(CACHE_TIER, namespace, "qwen-tier") is None

    await eventually(dropped, what="the dedicated CacheTier to go")


GEMMA = {
    "repo": "google/gemma-3-4b-it", "architecture": "Gemma3ForConditionalGeneration",
    "modalities": ["text", "image"],
}  # fmt: skip


def claim(namespace: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "10Gi"}}},
    }  # fmt: skip


async def test_a_model_on_a_volume_says_its_claim_is_missing_until_it_exists_and_is_mounted(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(cache_tier(namespace))
    model = {**GEMMA, "volume": {"claimName": "models", "path": "google/gemma-3-4b-it"}}
    await kube.create(model_recipe(namespace, model=model))
    recipe = await wait_for_condition(
        kube, namespace, "ModelRecipe", "qwen", "EngineReady", reason="VolumeNotFound"
    )
    message = condition(recipe, "EngineReady")["message"]
    assert "spec.model.volume.claimName" in message and "'models'" in message
    deployment = await kube.get(DEPLOYMENT, namespace, "qwen")
    assert deployment is not None  # applied anyway: its pods start once the claim exists
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:4] == [
        "--model", "/models/google/gemma-3-4b-it", "--served-model-name", "google/gemma-3-4b-it",
    ]  # fmt: skip
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in (
        pod["volumes"]
    )
    await kube.create(claim(namespace, "models"))
    await wait_for_condition(
        kube, namespace, "ModelRecipe", "qwen", "EngineReady", reason="ReplicasNotReady"
    )


async def test_a_gated_model_gets_its_cache_claim_and_says_its_token_secret_is_missing(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(cache_tier(namespace))
    model = {**GEMMA, "tokenSecretRef": {"name": "hf"}, "cache": {"size": "50Gi"}}
    await kube.create(model_recipe(namespace, model=model))
    recipe = await wait_for_condition(
        kube, namespace, "ModelRecipe", "qwen", "EngineReady", reason="SecretNotFound"
    )
    assert "spec.model.tokenSecretRef" in condition(recipe, "EngineReady")["message"]
    made = await eventually(lambda: kube.get(CLAIM, namespace, "qwen-model-cache"))
    assert made["spec"]["accessModes"] == ["ReadWriteMany"]
    assert made["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert made["metadata"]["ownerReferences"][0]["kind"] == "ModelRecipe"
    await kube.create({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf", "namespace": namespace},
        "stringData": {"token": "hf_not_a_real_token"},
    })  # fmt: skip
    await wait_for_condition(
        kube, namespace, "ModelRecipe", "qwen", "EngineReady", reason="ReplicasNotReady"
    )
    # Created once: a later size is not applied to the claim (resized on the claim itself).
    await kube.patch(MODEL_RECIPE, namespace, "qwen", {"spec": {"model": {"cache": {"size": "80Gi"}}}})
    await wait_for_condition(kube, namespace, "ModelRecipe", "qwen", "EngineReady", generation=2)
    again = await kube.get(CLAIM, namespace, "qwen-model-cache")
    assert again is not None and again["metadata"]["uid"] == made["metadata"]["uid"]
    assert again["spec"]["resources"]["requests"]["storage"] == "50Gi"


async def test_a_per_node_tier_is_a_daemonset_the_api_server_accepts_and_needs_redis(
    kube: KubeClient, namespace: str
) -> None:
    await kube.create(cache_tier(namespace, topology="perNode"))
    tier = await wait_for_condition(
        kube, namespace, "CacheTier", "shared", "Ready", reason="InvalidSpec"
    )
    assert condition(tier, "Ready")["message"].startswith("spec.topology: a per-node tier needs")
    assert await kube.get(DAEMONSET, namespace, "shared") is None  # nothing applied
    await kube.patch(CACHE_TIER, namespace, "shared", {"spec": {
        "redis": {"url": "redis://redis:6379/0"}, "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }})  # fmt: skip
    # No node here matches (there is no node at all): said, naming what to check.
    tier = await wait_for_condition(
        kube, namespace, "CacheTier", "shared", "Ready", reason="NoNodes", generation=2
    )
    assert "spec.nodeSelector" in condition(tier, "Ready")["message"]
    daemonset = await kube.get(DAEMONSET, namespace, "shared")
    assert daemonset is not None
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["securityContext"]["capabilities"]["add"] == ["CHOWN", "FOWNER"]
    (socket_dir,) = [v for v in pod["volumes"] if "hostPath" in v]
    assert socket_dir["hostPath"] == {
        "path": f"/var/run/kvtier/{namespace}/shared", "type": "DirectoryOrCreate"
    }
    await kube.create(model_recipe(namespace))
    await wait_for_condition(kube, namespace, "ModelRecipe", "qwen", "TierReady", reason="TierNotReady")
    deployment = await kube.get(DEPLOYMENT, namespace, "qwen")
    assert deployment is not None
    engine = deployment["spec"]["template"]["spec"]
    assert [v for v in engine["volumes"] if "hostPath" in v] == [socket_dir]
    config = await kube.get(CONFIGMAP, namespace, "qwen-kvtier")
    assert config is not None
    extra = json.loads(config["data"]["kv-transfer-config.json"])["kv_connector_extra_config"]
    assert extra["local_socket"] == "/run/kvtier/tier.sock"
    # Back to shared: the StatefulSet replaces the DaemonSet.
    await kube.patch(CACHE_TIER, namespace, "shared", {"spec": {"topology": "shared"}})
    await eventually(lambda: kube.get(STATEFULSET, namespace, "shared"), what="a StatefulSet")

    async def daemonset_gone() -> bool:
        return await kube.get(DAEMONSET, namespace, "shared") is None

    await eventually(daemonset_gone, what="the DaemonSet to go")
