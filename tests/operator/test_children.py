from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from kvtier.operator.children import (
    ClusterFeatures,
    cache_tier_children,
    engine_certificates,
    model_recipe_children,
    tier_certificates,
)
from kvtier.operator.quantity import parse_bytes
from kvtier.operator.spec import parse_cache_tier, parse_model_recipe, parse_tier_spec
from tests.operator import crdschema
from tests.operator.bodies import cache_tier, model_recipe

# The oldest and newest Kubernetes schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
DEFAULT_IMAGE = "ghcr.io/kvtier/kvtier-server:test"
AUTH = "tier-auth"  # the tier's auth Secret: one key per tenant
TLS = {"tls": {"secretName": "tier-tls", "clientAuth": True}}  # a mutual-TLS tier
GRPC_PROBES = ClusterFeatures(grpc_probes=True)

GEMMA = {
    "repo": "google/gemma-3-4b-it", "architecture": "Gemma3ForConditionalGeneration",
    "modalities": ["text", "image"],
}  # fmt: skip

PER_NODE = {
    "topology": "perNode",
    "redis": {"url": "redis://redis:6379/0", "cluster": True, "passwordSecretRef": {"name": "redis"}},
    "disk": {"size": "50Gi"}, "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
}  # fmt: skip

TIERS = {
    "defaults": {},
    "everything": {
        "replicas": 3, "image": "kvtier:1", "ramBytes": "8Gi", "ramRecycleBytes": "512Mi",
        "disk": {"size": "100Gi", "storageClassName": "local-nvme"},
        "redis": {"url": "rediss://redis:6380/0", "cluster": True,
                  "passwordSecretRef": {"name": "redis", "key": "pw"}},
        "authSecretRef": {"name": "tier-auth"}, "tenantQuotaBytes": "1Gi",
        "metrics": {"enabled": False},
        "resources": {"requests": {"cpu": "2", "memory": "9Gi"}, "limits": {"memory": "10Gi"}},
    },
    "ram only": {"disk": {"enabled": False}, "ramBytes": 1073741824},
    "tls": {"tls": {"secretName": "tier-tls"}},
    "mutual tls, two replicas": {"replicas": 2, **TLS},
    "no data port": {"dataPort": {"enabled": False}},
    "per node": PER_NODE,
}  # fmt: skip

RECIPES = {
    "defaults": {},
    "everything": {
        "engine": {"image": "vllm:1", "args": ["--max-model-len", "8192"], "replicas": 2, "gpus": 4,
                   "resources": {"requests": {"cpu": "8", "memory": "64Gi"}}},
        "cache": {"chunkSize": 512, "codec": "zstd", "saltPolicy": "namespace", "encoderCache": True,
                  "tenant": "team-a"},
        "tier": {"inline": TIERS["everything"]},
    },
    "cpu only": {"engine": {"image": "vllm:cpu", "gpus": 0}},
    "salt required": {"cache": {"saltPolicy": "required", "codec": "raw", "encoderCache": True}},
    "no salts": {"cache": {"saltPolicy": "none"}},
    "client certificate": {"cache": {"clientCertSecretRef": {"name": "engine-tls"}}},
    "model on a volume": {"model": {**GEMMA, "volume": {"claimName": "weights", "path": "gemma-3-4b-it"}}},
    "gated model, cache made": {"model": {**GEMMA, "tokenSecretRef": {"name": "hf", "key": "hf-token"},
                                          "cache": {"size": "100Gi", "storageClassName": "nfs"}}},
    "model cache claim": {"model": {**GEMMA, "cache": {"claimName": "hf-cache"}}},
}  # fmt: skip


def tier_children(features: ClusterFeatures = GRPC_PROBES, **spec: Any) -> list[dict[str, Any]]:
    return cache_tier_children(parse_cache_tier(cache_tier(**spec)), DEFAULT_IMAGE, features)


def recipe_children(
    tier_auth: str | None = None, tier_spec: dict[str, Any] | None = None, **spec: Any
) -> list[dict[str, Any]]:
    """A recipe's children, for a tier with ``tier_spec`` and the auth Secret ``tier_auth``."""
    tier = dict(tier_spec or {}) | ({"authSecretRef": {"name": tier_auth}} if tier_auth else {})
    recipe = parse_model_recipe(model_recipe(**spec))
    return model_recipe_children(recipe, parse_tier_spec(tier, "spec"))


def by_kind(children: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [c for c in children if c["kind"] == kind and name in (None, c["metadata"]["name"])]
    return found


def builtin_children() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for variant, spec in TIERS.items():
        for grpc in (True, False):
            for child in tier_children(ClusterFeatures(grpc_probes=grpc), **spec):
                out.append((f"tier {variant} grpc={grpc}: {child['kind']}", child))
    for variant, spec in RECIPES.items():
        for tls in (False, True):
            for child in recipe_children(AUTH, TLS if tls else None, **spec):
                if child["kind"] != "CacheTier":
                    out.append((f"recipe {variant} tls={tls}: {child['kind']}", child))
        for child in recipe_children(AUTH, PER_NODE, **spec):
            if child["kind"] != "CacheTier":
                out.append((f"recipe {variant} per node: {child['kind']}", child))
    return out


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    ("variant", "child"), builtin_children(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_built_in_child_validates_strictly_against_the_kubernetes_schemas(
    variant: str, child: dict[str, Any], version: str
) -> None:
    kubernetes_validate.validate(child, version, strict=True)


@pytest.mark.parametrize("variant", RECIPES)
def test_an_inline_tier_child_validates_against_the_cachetier_crd(variant: str) -> None:
    for child in recipe_children(**RECIPES[variant]):
        if child["kind"] == "CacheTier":
            crdschema.validate(child)


def test_every_child_is_controlled_by_its_parent_and_labelled_with_it() -> None:
    for child in tier_children() + recipe_children(tier={"inline": {}}):
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["controller"] is True and owner["blockOwnerDeletion"] is True
        assert owner["apiVersion"] == "kvtier.io/v1alpha1"
        assert child["metadata"]["namespace"] == "ml"
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvtier-operator"
        assert child["metadata"]["labels"]["app.kubernetes.io/instance"] == owner["name"]


def test_a_tier_is_a_configmap_a_statefulset_and_two_services() -> None:
    names = [(c["kind"], c["metadata"]["name"]) for c in tier_children()]
    assert names == [
        ("ConfigMap", "shared-settings"), ("StatefulSet", "shared"),
        ("Service", "shared-headless"), ("Service", "shared"),
    ]  # fmt: skip


def test_tier_settings_are_the_server_flags_as_env_vars() -> None:
    settings = by_kind(tier_children(**TIERS["everything"]), "ConfigMap")["data"]
    assert settings == {
        "KVTIER_HOST": "0.0.0.0",
        "KVTIER_PORT": "50051",
        "KVTIER_DATA_PORT": "50052",
        "KVTIER_METRICS_PORT": "0",
        "KVTIER_RAM_BYTES": str(8 * 2**30),
        "KVTIER_RAM_RECYCLE_BYTES": str(512 * 2**20),
        "KVTIER_DISK_DIR": "/var/lib/kvtier",
        "KVTIER_DISK_BYTES": str(int(100 * 2**30 * 0.9)),
        "KVTIER_REDIS_URL": "rediss+cluster://redis:6380/0",
        "KVTIER_AUTH_TOKENS": "/etc/kvtier/tenants",
        "KVTIER_TENANT_QUOTA_BYTES": str(2**30),
    }


@pytest.mark.parametrize("name", ["defaults", "everything", "ram only"])
def test_the_server_parses_every_setting_the_operator_emits(name: str, tmp_path: Path) -> None:
    from kvtier.cacheserver.settings import parse

    children = tier_children(**TIERS[name])
    settings = dict(by_kind(children, "ConfigMap")["data"])
    # Paths the server checks at start are mounted into the pod; here a local stand-in.
    (container,) = by_kind(children, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    mounted = {m["mountPath"] for m in container.get("volumeMounts", [])}
    for key, value in list(settings.items()):
        if key == "KVTIER_AUTH_TOKENS" or key.endswith("_FILE"):
            assert any(value.startswith(m) for m in mounted), f"{key}={value} is not mounted"
            stand_in = tmp_path / key
            if key == "KVTIER_AUTH_TOKENS":  # a folder of tenant token files
                stand_in.mkdir()
            else:
                stand_in.write_text("x")
            settings[key] = str(stand_in)
    parsed = parse([], env=settings)
    assert parsed.ram_bytes == parse_bytes(TIERS[name].get("ramBytes", "2Gi"))
    assert "KVTIER_RAM_RECYCLE_BYTES" in settings or parsed.ram_recycle_bytes == 256 << 20
    if name == "everything":
        assert parsed.ram_recycle_bytes == 512 << 20


def test_the_tier_server_reads_its_settings_and_the_redis_password_from_kubernetes_objects() -> (
    None
):
    statefulset = by_kind(tier_children(**TIERS["everything"]), "StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["kvtier-server"]
    assert container["envFrom"] == [{"configMapRef": {"name": "shared-settings"}}]
    assert container["env"] == [{
        "name": "KVTIER_REDIS_PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "redis", "key": "pw"}},
    }]  # fmt: skip


def test_the_tier_disk_is_one_claim_per_replica_of_the_requested_size_and_class() -> None:
    statefulset = by_kind(tier_children(**TIERS["everything"]), "StatefulSet")
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "100Gi"
    assert claim["spec"]["storageClassName"] == "local-nvme"
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert {"name": "data", "mountPath": "/var/lib/kvtier"} in container["volumeMounts"]


def test_a_ram_only_tier_has_no_claim_and_no_disk_settings() -> None:
    children = tier_children(**TIERS["ram only"])
    assert "volumeClaimTemplates" not in by_kind(children, "StatefulSet")["spec"]
    settings = by_kind(children, "ConfigMap")["data"]
    assert "KVTIER_DISK_DIR" not in settings
    assert settings["KVTIER_DISK_BYTES"] == "0"  # the server's own default is a disk tier


def test_tier_memory_is_the_ram_tier_plus_headroom_unless_resources_are_given() -> None:
    (container,) = by_kind(tier_children(ramBytes="2Gi"), "StatefulSet")["spec"]["template"][
        "spec"
    ]["containers"]
    assert container["resources"] == {
        "requests": {"memory": "2560Mi"},
        "limits": {"memory": "2560Mi"},
    }
    (container,) = by_kind(tier_children(**TIERS["everything"]), "StatefulSet")["spec"]["template"][
        "spec"
    ]["containers"]
    assert container["resources"]["limits"] == {"memory": "10Gi"}


def test_tier_probes_use_grpc_health_and_fall_back_to_tcp_before_kubernetes_1_24() -> None:
    for grpc, expected in (
        (True, {"grpc": {"port": 50051}}),
        (False, {"tcpSocket": {"port": 50051}}),
    ):
        statefulset = by_kind(tier_children(ClusterFeatures(grpc_probes=grpc)), "StatefulSet")
        (container,) = statefulset["spec"]["template"]["spec"]["containers"]
        for probe in ("readinessProbe", "livenessProbe"):
            assert expected.items() <= container[probe].items()


def test_metrics_on_names_the_port_and_adds_scrape_annotations_and_off_removes_them() -> None:
    on, off = tier_children(), tier_children(metrics={"enabled": False})
    assert [p["name"] for p in by_kind(on, "Service", "shared")["spec"]["ports"]] == [
        "grpc",
        "data",
        "metrics",
    ]
    assert [p["name"] for p in by_kind(off, "Service", "shared")["spec"]["ports"]] == [
        "grpc",
        "data",
    ]
    annotations = by_kind(on, "StatefulSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9400"
    assert (
        "prometheus.io/scrape"
        not in by_kind(off, "StatefulSet")["spec"]["template"]["metadata"]["annotations"]
    )


def test_changing_a_tier_setting_changes_the_pod_template_so_pods_roll() -> None:
    def template_hash(**spec: Any) -> str:
        statefulset = by_kind(tier_children(**spec), "StatefulSet")
        return str(
            statefulset["spec"]["template"]["metadata"]["annotations"]["kvtier.io/settings-hash"]
        )

    assert template_hash(ramBytes="2Gi") == template_hash(ramBytes="2Gi")
    assert template_hash(ramBytes="2Gi") != template_hash(ramBytes="3Gi")


def test_a_recipe_is_a_configmap_a_deployment_and_a_service_plus_its_inline_tier() -> None:
    names = [(c["kind"], c["metadata"]["name"]) for c in recipe_children(tier={"inline": {}})]
    assert names == [
        ("CacheTier", "qwen-tier"), ("ConfigMap", "qwen-kvtier"),
        ("Deployment", "qwen"), ("Service", "qwen"),
    ]  # fmt: skip


def test_the_kv_transfer_config_loads_the_kvtier_connector_pointed_at_the_tier_service() -> None:
    config = by_kind(recipe_children(), "ConfigMap")["data"]
    assert set(config) == {"kv-transfer-config.json"}
    assert json.loads(config["kv-transfer-config.json"]) == {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "target": "shared.ml.svc:50051", "chunk_size": 256, "codec": "raw", "salt_policy": "request",
        },
    }  # fmt: skip


def test_the_engine_gets_the_transfer_configs_from_the_configmap_through_env_vars() -> None:
    deployment = by_kind(recipe_children(cache={"encoderCache": True}), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"][:6] == [
        "--model", "Qwen/Qwen2.5-VL-7B-Instruct", "--revision", "main", "--port", "8000",
    ]  # fmt: skip
    assert container["args"][6:] == [
        "--kv-transfer-config", "$(KVTIER_KV_TRANSFER_CONFIG)",
        "--ec-transfer-config", "$(KVTIER_EC_TRANSFER_CONFIG)",
    ]  # fmt: skip
    sources = {
        e["name"]: e["valueFrom"]["configMapKeyRef"] for e in container["env"] if "valueFrom" in e
    }
    assert sources == {
        "KVTIER_KV_TRANSFER_CONFIG": {"name": "qwen-kvtier", "key": "kv-transfer-config.json"},
        "KVTIER_EC_TRANSFER_CONFIG": {"name": "qwen-kvtier", "key": "ec-transfer-config.json"},
    }


def test_the_encoder_cache_config_loads_the_kvtier_ec_connector() -> None:
    config = by_kind(recipe_children(cache={"encoderCache": True}), "ConfigMap")["data"]
    ec = json.loads(config["ec-transfer-config.json"])
    assert (ec["ec_connector"], ec["ec_connector_module_path"], ec["ec_role"]) == (
        "KvtierECConnector", "kvtier.connector.ec", "ec_both",
    )  # fmt: skip
    assert ec["ec_connector_extra_config"]["target"] == "shared.ml.svc:50051"


def test_user_args_come_after_the_operators_own() -> None:
    deployment = by_kind(recipe_children(**RECIPES["everything"]), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"][-2:] == ["--max-model-len", "8192"]


def test_gpus_become_an_nvidia_gpu_limit_and_zero_gpus_none() -> None:
    def limits(**spec: Any) -> dict[str, Any]:
        (container,) = by_kind(recipe_children(**spec), "Deployment")["spec"]["template"]["spec"][
            "containers"
        ]
        return dict(container["resources"].get("limits", {}))

    assert limits(**RECIPES["everything"]) == {"nvidia.com/gpu": "4"}
    assert limits(**RECIPES["cpu only"]) == {}


def test_the_namespace_salt_policy_salts_keys_with_the_namespace() -> None:
    config = by_kind(recipe_children(cache={"saltPolicy": "namespace"}), "ConfigMap")["data"]
    extra = json.loads(config["kv-transfer-config.json"])["kv_connector_extra_config"]
    # The connector knows request, none and required: namespace is request plus a fixed salt.
    assert (extra["salt_policy"], extra["salt"]) == ("request", "ml")


def test_a_tier_with_auth_mounts_the_recipes_tenant_token_into_the_engine() -> None:
    children = recipe_children(AUTH, cache={"tenant": "team-a"})
    extra = json.loads(by_kind(children, "ConfigMap")["data"]["kv-transfer-config.json"])
    assert extra["kv_connector_extra_config"]["auth_token_file"] == "/etc/kvtier/auth/token"
    pod = by_kind(children, "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "kvtier-auth")
    assert volume["secret"] == {
        "secretName": "tier-auth",
        "items": [{"key": "team-a", "path": "token"}],
    }


def test_a_tier_with_auth_mounts_its_whole_secret_as_the_tenant_directory() -> None:
    statefulset = by_kind(tier_children(authSecretRef={"name": "tier-auth"}), "StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    assert {"name": "tenants", "secret": {"secretName": "tier-auth"}} in pod["volumes"]
    (container,) = pod["containers"]
    assert {"name": "tenants", "mountPath": "/etc/kvtier/tenants", "readOnly": True} in container[
        "volumeMounts"
    ]


def test_a_tier_serves_the_data_port_on_the_client_and_headless_services() -> None:
    children = tier_children()
    (container,) = by_kind(children, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert {"name": "data", "containerPort": 50052, "protocol": "TCP"} in container["ports"]
    for name in ("shared", "shared-headless"):
        ports = by_kind(children, "Service", name)["spec"]["ports"]
        assert {"name": "data", "port": 50052, "targetPort": "data", "protocol": "TCP"} in ports


def test_a_new_kv_transfer_config_changes_the_engine_template_so_engines_roll() -> None:
    def template_hash(**spec: Any) -> str:
        deployment = by_kind(recipe_children(**spec), "Deployment")
        return str(
            deployment["spec"]["template"]["metadata"]["annotations"]["kvtier.io/settings-hash"]
        )

    assert template_hash(cache={"chunkSize": 256}) != template_hash(cache={"chunkSize": 512})


def pod_templates(*, per_node: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """Pod templates of the built-in children: those of per-node tiers and their engines
    (which mount a hostPath), or all others."""
    out = []
    for variant, child in builtin_children():
        workload = child["kind"] in ("StatefulSet", "Deployment", "DaemonSet")
        if workload and ("per node" in variant) == per_node:
            out.append((variant, child["spec"]["template"]["spec"]))
    return out


@pytest.mark.parametrize(
    ("variant", "pod"), pod_templates(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_pod_template_meets_the_restricted_pod_security_profile(
    variant: str, pod: dict[str, Any]
) -> None:
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for volume in pod.get("volumes", []):  # restricted allows only these volume types
        assert set(volume) - {"name"} <= {
            "emptyDir",
            "secret",
            "configMap",
            "persistentVolumeClaim",
        }
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        assert context["readOnlyRootFilesystem"] is True
        assert "privileged" not in context and "runAsUser" not in context
        assert all("hostPort" not in port for port in container["ports"])
        # The root filesystem is read-only: /tmp is a volume of its own.
        assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])


def test_engines_write_their_caches_to_an_empty_dir_home() -> None:
    pod = by_kind(recipe_children(), "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HOME"] == "/home/vllm" and env["USER"] == "vllm"
    assert {"name": "home", "mountPath": "/home/vllm"} in container["volumeMounts"]
    assert {"name": "home", "emptyDir": {}} in pod["volumes"]


def test_a_tier_can_turn_its_data_port_off() -> None:
    children = tier_children(dataPort={"enabled": False})
    assert by_kind(children, "ConfigMap")["data"]["KVTIER_DATA_PORT"] == "0"  # the server's off
    (container,) = by_kind(children, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert [p["name"] for p in container["ports"]] == ["grpc", "metrics"]
    for name in ("shared", "shared-headless"):
        ports = by_kind(children, "Service", name)["spec"]["ports"]
        assert "data" not in [p["name"] for p in ports]


def test_several_replicas_without_redis_leave_the_data_port_off_and_with_redis_on() -> None:
    def data_port(**spec: Any) -> str:
        return str(by_kind(tier_children(**spec), "ConfigMap")["data"]["KVTIER_DATA_PORT"])

    assert data_port(replicas=1) == "50052"
    assert data_port(replicas=3) == "0"  # a gRPC and a data connection may reach two replicas
    assert data_port(replicas=3, redis={"url": "redis://redis:6379/0"}) == "50052"


def test_each_engine_pod_sticks_to_one_tier_replica() -> None:
    service = by_kind(tier_children(replicas=3), "Service", "shared")
    assert service["spec"]["sessionAffinity"] == "ClientIP"


def test_a_tls_tier_mounts_its_certificate_and_key_and_probes_over_tcp() -> None:
    children = tier_children(tls={"secretName": "tier-tls"})
    settings = by_kind(children, "ConfigMap")["data"]
    assert settings["KVTIER_TLS_CERT_FILE"] == "/etc/kvtier/tls/tls.crt"
    assert settings["KVTIER_TLS_KEY_FILE"] == "/etc/kvtier/tls/tls.key"
    assert "KVTIER_TLS_CLIENT_CA_FILE" not in settings  # no client certificates asked for
    pod = by_kind(children, "StatefulSet")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert volume["secret"] == {
        "secretName": "tier-tls",
        "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}],
    }
    (container,) = pod["containers"]
    assert {"name": "tls", "mountPath": "/etc/kvtier/tls", "readOnly": True} in container[
        "volumeMounts"
    ]
    # The kubelet's gRPC probe speaks plaintext only.
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["tcpSocket"] == {"port": 50051} and "grpc" not in container[probe]


def test_a_mutual_tls_tier_verifies_clients_with_its_secrets_ca() -> None:
    children = tier_children(**TLS)
    settings = by_kind(children, "ConfigMap")["data"]
    assert settings["KVTIER_TLS_CLIENT_CA_FILE"] == "/etc/kvtier/tls/ca.crt"
    pod = by_kind(children, "StatefulSet")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert [item["key"] for item in volume["secret"]["items"]] == ["tls.crt", "tls.key", "ca.crt"]


def test_engines_of_a_tls_tier_get_only_its_ca_and_present_their_client_certificate() -> None:
    children = recipe_children(None, TLS, cache={"clientCertSecretRef": {"name": "engine-tls"}})
    extra = json.loads(by_kind(children, "ConfigMap")["data"]["kv-transfer-config.json"])[
        "kv_connector_extra_config"
    ]
    assert extra["tls_ca_file"] == "/etc/kvtier/tls/ca.crt"
    assert extra["tls_cert_file"] == "/etc/kvtier/client-tls/tls.crt"
    assert extra["tls_key_file"] == "/etc/kvtier/client-tls/tls.key"
    pod = by_kind(children, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    # Never the tier's private key: only ca.crt of its Secret.
    assert volumes["kvtier-tls"] == {
        "secretName": "tier-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }  # fmt: skip
    assert volumes["kvtier-client-tls"]["secretName"] == "engine-tls"
    assert [i["key"] for i in volumes["kvtier-client-tls"]["items"]] == ["tls.crt", "tls.key"]


def test_engines_of_a_plaintext_tier_get_no_tls_settings_even_with_a_client_certificate() -> None:
    children = recipe_children(cache={"clientCertSecretRef": {"name": "engine-tls"}})
    extra = json.loads(by_kind(children, "ConfigMap")["data"]["kv-transfer-config.json"])[
        "kv_connector_extra_config"
    ]
    assert not any(key.startswith("tls_") for key in extra)
    pod = by_kind(children, "Deployment")["spec"]["template"]["spec"]
    assert all("secret" not in volume for volume in pod["volumes"])


def test_a_certificates_hash_goes_into_the_pod_templates_so_renewals_roll_the_pods() -> None:
    def annotations(children: list[dict[str, Any]], kind: str) -> dict[str, str]:
        return dict(by_kind(children, kind)["spec"]["template"]["metadata"]["annotations"])

    tier = cache_tier_children(
        parse_cache_tier(cache_tier(**TLS)), DEFAULT_IMAGE, GRPC_PROBES, "h1"
    )
    assert annotations(tier, "StatefulSet")["kvtier.io/certificates-hash"] == "h1"
    recipe = parse_model_recipe(model_recipe())
    engine = model_recipe_children(recipe, parse_tier_spec(TLS, "spec"), "h2")
    assert annotations(engine, "Deployment")["kvtier.io/certificates-hash"] == "h2"
    assert "kvtier.io/certificates-hash" not in annotations(tier_children(), "StatefulSet")


def test_the_certificates_an_engine_mounts_are_the_tiers_ca_and_its_own_pair() -> None:
    recipe = parse_model_recipe(model_recipe(cache={"clientCertSecretRef": {"name": "engine-tls"}}))
    tier = parse_tier_spec(TLS, "spec")
    assert engine_certificates(recipe, tier).secrets() == [
        ("tier-tls", ("ca.crt",)), ("engine-tls", ("tls.crt", "tls.key")),
    ]  # fmt: skip
    assert engine_certificates(recipe, parse_tier_spec({}, "spec")).secrets() == []
    assert tier_certificates(tier).secrets() == [("tier-tls", ("tls.crt", "tls.key", "ca.crt"))]


def engine_container(children: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = by_kind(children, "Deployment")["spec"]["template"]["spec"]["containers"]
    return dict(container)


def test_a_model_on_a_volume_is_loaded_read_only_and_served_under_the_recipes_model_name() -> None:
    children = recipe_children(**RECIPES["model on a volume"])
    container = engine_container(children)
    assert container["args"][:8] == [
        "--model", "/models/gemma-3-4b-it", "--served-model-name", "google/gemma-3-4b-it",
        "--revision", "main", "--port", "8000",
    ]  # fmt: skip
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
    pod = by_kind(children, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod[
        "volumes"
    ]
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    assert "PersistentVolumeClaim" not in [c["kind"] for c in children]  # the user's claim


def test_a_model_on_a_volume_keys_its_entries_by_the_models_name_not_the_path() -> None:
    config = by_kind(recipe_children(**RECIPES["model on a volume"]), "ConfigMap")["data"]
    extra = json.loads(config["kv-transfer-config.json"])["kv_connector_extra_config"]
    assert extra["model_id"] == "google/gemma-3-4b-it"
    hub = by_kind(recipe_children(), "ConfigMap")["data"]
    assert "model_id" not in json.loads(hub["kv-transfer-config.json"])["kv_connector_extra_config"]


def test_a_hub_model_keeps_its_repo_as_model_and_gets_no_offline_mode_or_volumes() -> None:
    container = engine_container(recipe_children())
    assert container["args"][:2] == ["--model", "Qwen/Qwen2.5-VL-7B-Instruct"]
    assert "--served-model-name" not in container["args"]
    assert not {"HF_HUB_OFFLINE", "HF_TOKEN", "HF_HOME"} & {e["name"] for e in container["env"]}


def test_a_gated_model_gets_the_hub_token_from_its_secret_key_as_hf_token() -> None:
    container = engine_container(recipe_children(**RECIPES["gated model, cache made"]))
    assert {
        "name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "hf-token"}},
    } in container["env"]  # fmt: skip


def test_a_model_cache_of_a_size_is_a_claim_the_recipe_owns_mounted_as_hf_home() -> None:
    children = recipe_children(**RECIPES["gated model, cache made"])
    claim = by_kind(children, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "qwen-model-cache"
    assert claim["metadata"]["ownerReferences"][0]["name"] == "qwen"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "100Gi"}},
        "storageClassName": "nfs",
    }  # fmt: skip
    container = engine_container(children)
    assert {"name": "HF_HOME", "value": "/var/cache/huggingface"} in container["env"]
    assert {"name": "model-cache", "mountPath": "/var/cache/huggingface"} in container["volumeMounts"]
    pod = by_kind(children, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "qwen-model-cache"}} in pod[
        "volumes"
    ]


def test_an_existing_model_cache_claim_is_mounted_and_not_made() -> None:
    children = recipe_children(**RECIPES["model cache claim"])
    assert "PersistentVolumeClaim" not in [c["kind"] for c in children]
    pod = by_kind(children, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod[
        "volumes"
    ]


def test_a_tier_without_a_tenant_quota_sets_none_and_zero_is_none() -> None:
    for spec in ({}, {"tenantQuotaBytes": 0}, {"tenantQuotaBytes": "0"}):
        settings = by_kind(tier_children(**spec), "ConfigMap")["data"]
        assert "KVTIER_TENANT_QUOTA_BYTES" not in settings


def test_a_per_node_tier_is_a_daemonset_on_the_engine_nodes_with_its_socket_on_the_node() -> None:
    children = tier_children(**PER_NODE)
    assert [c["kind"] for c in children] == ["ConfigMap", "DaemonSet", "Service", "Service"]
    daemonset = by_kind(children, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == PER_NODE["tolerations"]
    assert {"name": "kvtier-socket", "hostPath": {
        "path": "/var/run/kvtier/ml/shared", "type": "DirectoryOrCreate"}} in pod["volumes"]
    (container,) = pod["containers"]
    assert {"name": "kvtier-socket", "mountPath": "/run/kvtier"} in container["volumeMounts"]
    settings = by_kind(children, "ConfigMap")["data"]
    assert settings["KVTIER_LOCAL_SOCKET"] == "/run/kvtier/tier.sock"
    assert settings["KVTIER_REDIS_URL"] == "redis+cluster://redis:6379/0"
    # The TCP fallback: the tier's Service selects every node's tier pod.
    service = by_kind(children, "Service", "shared")
    assert service["spec"]["selector"] == daemonset["spec"]["selector"]["matchLabels"]


def test_a_per_node_tier_keeps_its_disk_in_an_empty_dir_of_the_disk_size() -> None:
    children = tier_children(**PER_NODE)
    pod = by_kind(children, "DaemonSet")["spec"]["template"]["spec"]
    assert {"name": "data", "emptyDir": {"sizeLimit": "50Gi"}} in pod["volumes"]
    assert {"name": "data", "mountPath": "/var/lib/kvtier"} in pod["containers"][0]["volumeMounts"]
    assert by_kind(children, "ConfigMap")["data"]["KVTIER_DISK_BYTES"] == str(int(50 * 2**30 * 0.9))
    ram_only = tier_children(**{**PER_NODE, "disk": {"enabled": False}})
    pod = by_kind(ram_only, "DaemonSet")["spec"]["template"]["spec"]
    assert "data" not in [v["name"] for v in pod["volumes"]]


def test_the_socket_directory_is_handed_to_the_tier_user_by_an_init_container_that_can_only_chown(
) -> None:  # fmt: skip
    pod = by_kind(tier_children(**PER_NODE), "DaemonSet")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["image"] == DEFAULT_IMAGE  # the tier's image: it has Python
    assert init["command"][:2] == ["python3", "-c"]
    assert "os.chown(d, 65532, 65532)" in init["command"][2] and "0o750" in init["command"][2]
    assert init["securityContext"] == {
        "runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }  # fmt: skip
    assert init["volumeMounts"] == [{"name": "kvtier-socket", "mountPath": "/run/kvtier"}]


def test_two_tiers_never_share_a_socket_directory() -> None:
    from kvtier.operator.topology import host_socket_dir

    assert host_socket_dir("a-b", "c") != host_socket_dir("a", "b-c")


def test_engines_of_a_per_node_tier_mount_its_node_directory_and_try_the_socket_first() -> None:
    children = recipe_children(None, PER_NODE)
    extra = json.loads(by_kind(children, "ConfigMap")["data"]["kv-transfer-config.json"])[
        "kv_connector_extra_config"
    ]
    assert extra["local_socket"] == "/run/kvtier/tier.sock"
    assert extra["target"] == "shared.ml.svc:50051"  # where no tier pod runs on the node
    pod = by_kind(children, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "kvtier-socket", "hostPath": {
        "path": "/var/run/kvtier/ml/shared", "type": "DirectoryOrCreate"}} in pod["volumes"]
    assert {"name": "kvtier-socket", "mountPath": "/run/kvtier"} in pod["containers"][0][
        "volumeMounts"
    ]
    assert pod["securityContext"]["supplementalGroups"] == [65532]  # the socket's group
    shared = recipe_children()
    assert "local_socket" not in json.loads(
        by_kind(shared, "ConfigMap")["data"]["kv-transfer-config.json"]
    )["kv_connector_extra_config"]


@pytest.mark.parametrize(
    ("variant", "pod"), pod_templates(per_node=True), ids=lambda v: v if isinstance(v, str) else ""
)
def test_per_node_pods_run_non_root_unprivileged_off_the_hosts_namespaces_with_one_host_path(
    variant: str, pod: dict[str, Any]
) -> None:
    for key in ("hostNetwork", "hostIPC", "hostPID"):
        assert key not in pod
    assert pod["securityContext"]["runAsNonRoot"] is True
    host_paths = [v["hostPath"] for v in pod["volumes"] if "hostPath" in v]
    assert len(host_paths) == 1 and host_paths[0]["path"].startswith("/var/run/kvtier/")
    for container in pod["containers"]:  # as restricted as any other pod's
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and "privileged" not in context
        assert context["capabilities"] == {"drop": ["ALL"]} and "runAsUser" not in context
    for init in pod.get("initContainers", []):  # only the directory's owner changes as root
        context = init["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and "privileged" not in context
        assert context["capabilities"]["add"] == ["CHOWN", "FOWNER"]
