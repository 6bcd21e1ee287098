"""The chart as rendered by the real ``helm``, for every scenario under ``helm/kvtier/ci/``.

Built-in objects are validated against the official Kubernetes schemas
(kubernetes-validate, strict), the default CacheTier against the project's
own CRD, and every pod against the Pod Security "restricted" profile.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvtier.operator.children import ClusterFeatures
from tests.helm.conftest import CHART, ROOT, SCENARIOS, Helm, MonitoringModels, scenario_flags
from tests.operator import crdschema

KUBERNETES_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
CUSTOM_KINDS = {"CacheTier", "ModelRecipe", *MONITORING_KINDS}
POD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "Pod"}
scenarios = pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda p: p.name)


def render(helm: Helm, scenario: Path) -> list[dict[str, Any]]:
    return helm.template(scenario, flags=scenario_flags(scenario))


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [obj for obj in of_kind(objects, kind) if obj["metadata"]["name"] == name]
    return found


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        if obj["kind"] == "Pod":
            yield f"Pod {obj['metadata']['name']}", obj["spec"]
        elif obj["kind"] in POD_KINDS:
            yield f"{obj['kind']} {obj['metadata']['name']}", obj["spec"]["template"]["spec"]


@scenarios
def test_the_chart_lints_strictly(helm: Helm, scenario: Path) -> None:
    helm.run("lint", "--strict", CHART, "--values", scenario)


@scenarios
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_built_in_object_validates_strictly(
    helm: Helm, scenario: Path, version: str
) -> None:
    for obj in render(helm, scenario):
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, version, strict=True)


@scenarios
def test_the_default_cache_tier_validates_against_the_cachetier_crd(
    helm: Helm, scenario: Path
) -> None:
    for tier in of_kind(render(helm, scenario), "CacheTier"):
        crdschema.validate(tier)


@scenarios
def test_every_pod_meets_the_restricted_pod_security_profile(helm: Helm, scenario: Path) -> None:
    specs = list(pod_specs(render(helm, scenario)))
    assert specs
    for where, spec in specs:
        pod_security = spec["securityContext"]
        assert pod_security["runAsNonRoot"] is True, where
        assert pod_security["runAsUser"] != 0, where
        assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not any(spec.get(host) for host in ("hostNetwork", "hostPID", "hostIPC")), where
        for volume in spec.get("volumes", []):
            assert set(volume) - {"name"} <= {"emptyDir", "secret", "configMap", "projected",
                                              "persistentVolumeClaim"}, where  # fmt: skip
        for container in spec["containers"] + spec.get("initContainers", []):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"] == {"drop": ["ALL"]}, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security.get("privileged", False) is False, where
            assert security["runAsNonRoot"] is True, where


@scenarios
def test_no_rbac_rule_uses_a_wildcard(helm: Helm, scenario: Path) -> None:
    for obj in render(helm, scenario):
        for rule in obj.get("rules", []) if obj["kind"] in {"Role", "ClusterRole"} else []:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert not any("*" in item for item in rule.get(field, [])), (obj, rule)


def test_the_chart_ships_the_operators_crds_byte_for_byte() -> None:
    shipped = sorted(path.name for path in (CHART / "crds").glob("*.yaml"))
    source = sorted(path.name for path in (ROOT / "operator" / "kvtier" / "operator" / "crds").glob("*.yaml"))
    assert shipped == source
    for name in source:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "operator" / "kvtier" / "operator" / "crds" / name).read_bytes(), (
            f"helm/kvtier/crds/{name} differs from operator/kvtier/operator/crds/{name}: "
            "cp operator/kvtier/operator/crds/*.yaml helm/kvtier/crds/"
        )


def test_the_chart_renders_the_operators_crds(helm: Helm) -> None:
    rendered = of_kind(helm.template(), "CustomResourceDefinition")
    source = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "operator" / "kvtier" / "operator" / "crds").glob("*.yaml"))]
    assert sorted(rendered, key=lambda c: c["metadata"]["name"]) == source


def test_the_cluster_role_has_exactly_the_rules_of_operator_rbac_yaml(helm: Helm) -> None:
    assert (CHART / "files" / "operator" / "rbac.yaml").read_bytes() == (
        ROOT / "operator" / "kvtier" / "operator" / "rbac.yaml"
    ).read_bytes(), "cp operator/kvtier/operator/rbac.yaml helm/kvtier/files/operator/rbac.yaml"
    role = named(helm.template(), "ClusterRole", "kvtier-operator")
    assert role["rules"] == yaml.safe_load((ROOT / "operator" / "kvtier" / "operator" / "rbac.yaml").read_text())["rules"]


def test_the_cluster_role_is_bound_to_the_operators_service_account(helm: Helm) -> None:
    objects = helm.template(namespace="infra")
    binding = named(objects, "ClusterRoleBinding", "kvtier-operator")
    deployment = named(objects, "Deployment", "kvtier-operator")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert named(objects, "ServiceAccount", account)["metadata"]["namespace"] == "infra"
    assert binding["roleRef"]["name"] == "kvtier-operator"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "infra"}]


def test_the_operator_runs_kvtier_operator_with_its_liveness_probe(helm: Helm) -> None:
    deployment = named(helm.template(), "Deployment", "kvtier-operator")
    assert deployment["spec"]["replicas"] == 1
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/kvtier/kvtier-operator:0.1.0"
    assert container["command"] == ["kvtier-operator"]
    assert container["args"] == [
        "--all-namespaces",
        "--tier-image=ghcr.io/kvtier/kvtier-server:0.1.0",
        "--resync-seconds=30",
        "--traffic-seconds=30",
        "--liveness=http://0.0.0.0:8080/healthz",
    ]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in container["ports"]


def test_the_operators_flags_are_ones_kvtier_operator_accepts(helm: Helm) -> None:
    from kvtier.operator.main import build_parser

    for scenario in SCENARIOS:
        deployment = named(render(helm, scenario), "Deployment", "kvtier-operator")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        build_parser().parse_args(container["args"])


def test_image_repository_and_tag_are_values(helm: Helm, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(
        "image: {repository: registry.example/op, tag: dev-1}\n"
        "tierImage: {repository: registry.example/tier, tag: dev-2}\n"
    )
    objects = helm.template(values)
    images = {where: [c["image"] for c in spec["containers"]] for where, spec in pod_specs(objects)}
    assert images == {
        "Deployment kvtier-operator": ["registry.example/op:dev-1"],
        "Pod kvtier-test-tier-health": ["registry.example/tier:dev-2"],
        "Pod kvtier-delete-default-tier": ["registry.example/op:dev-1"],  # the pre-delete hook
    }
    operator = named(objects, "Deployment", "kvtier-operator")["spec"]["template"]["spec"]
    assert "--tier-image=registry.example/tier:dev-2" in operator["containers"][0]["args"]


def test_the_default_tier_is_a_cachetier_resource_with_ram_and_disk(helm: Helm) -> None:
    objects = helm.template()
    (tier,) = of_kind(objects, "CacheTier")
    assert tier["metadata"] | {"labels": None} == {"name": "kvtier", "namespace": "kvtier", "labels": None}
    assert tier["spec"] == {
        "replicas": 1,
        "ramBytes": "2Gi",
        "disk": {"enabled": True, "size": "20Gi"},
        "metrics": {"enabled": True},
    }
    assert not of_kind(objects, "StatefulSet"), "the operator, not the chart, makes the StatefulSet"


def test_in_chart_redis_wires_the_tier_to_the_charts_redis_and_its_secret(helm: Helm) -> None:
    objects = render(helm, CHART / "ci" / "in-chart-redis-values.yaml")
    (tier,) = of_kind(objects, "CacheTier")
    assert tier["spec"]["redis"] == {
        "url": "redis://kvtier-redis.kvtier.svc:6379/0",
        "cluster": False,
        "passwordSecretRef": {"name": "kvtier-redis", "key": "password"},
    }
    secret = named(objects, "Secret", "kvtier-redis")
    assert len(secret["data"]["password"]) >= 40  # base64 of 32 random characters
    service = named(objects, "Service", "kvtier-redis")
    redis = named(objects, "Deployment", "kvtier-redis")
    assert service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert "--maxmemory 512mb --maxmemory-policy allkeys-lru" in container["args"][0]


def test_external_redis_uses_its_url_and_existing_secret_and_installs_no_redis(helm: Helm) -> None:
    objects = render(helm, CHART / "ci" / "external-redis-values.yaml")
    (tier,) = of_kind(objects, "CacheTier")
    assert tier["spec"]["redis"] == {
        "url": "rediss://redis.cache.svc:6379",
        "cluster": True,
        "passwordSecretRef": {"name": "kvtier-redis-password", "key": "redis-password"},
    }
    assert tier["spec"]["disk"] == {"enabled": False}
    assert not [obj for obj in objects if "redis" in obj["metadata"]["name"]]


def test_tier_auth_names_the_secret_of_tenant_tokens(helm: Helm) -> None:
    (tier,) = of_kind(render(helm, CHART / "ci" / "external-redis-values.yaml"), "CacheTier")
    assert tier["spec"]["authSecretRef"] == {"name": "kvtier-tenants"}
    (tier,) = of_kind(helm.template(), "CacheTier")
    assert "authSecretRef" not in tier["spec"]


def test_without_crds_nothing_needs_them_and_the_operator_watches_the_named_namespaces(
    helm: Helm,
) -> None:
    scenario = CHART / "ci" / "no-crds-values.yaml"
    assert scenario_flags(scenario) == ["--skip-crds"]
    objects = render(helm, scenario)
    kinds = {obj["kind"] for obj in objects}
    assert not kinds & {"CustomResourceDefinition", "CacheTier", "ClusterRole", "ServiceAccount"}
    deployment = named(objects, "Deployment", "kvtier-operator")
    spec = deployment["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "kvtier-operator"
    assert spec["containers"][0]["args"][:2] == ["--namespace=team-a", "--namespace=ml-*"]


def test_monitoring_on_renders_a_service_monitor_for_every_tier_and_the_tier_down_alert(
    helm: Helm,
) -> None:
    objects = render(helm, CHART / "ci" / "monitoring-values.yaml")
    (monitor,) = of_kind(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "monitoring"
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kvtier", "app.kubernetes.io/component": "cache-tier",
    }  # fmt: skip
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    (rule,) = of_kind(objects, "PrometheusRule")
    files = sorted((CHART / "files" / "rules").glob("*.yaml"))
    assert rule["spec"]["groups"] == [g for f in files for g in yaml.safe_load(f.read_text())["groups"]]
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert "KvtierTierDown" in alerts


def test_monitoring_on_renders_a_pod_monitor_for_the_engines_vllm_metrics(helm: Helm) -> None:
    objects = render(helm, CHART / "ci" / "monitoring-values.yaml")
    (monitor,) = of_kind(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "monitoring"
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kvtier", "app.kubernetes.io/component": "engine",
    }  # fmt: skip
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "30s"}
    ]


def test_the_pod_monitor_selects_the_engine_pods_and_port_the_operator_creates(helm: Helm) -> None:
    from kvtier.operator.children import model_recipe_children
    from kvtier.operator.spec import parse_model_recipe
    from tests.operator.bodies import model_recipe

    (monitor,) = of_kind(render(helm, CHART / "ci" / "monitoring-values.yaml"), "PodMonitor")
    children = model_recipe_children(parse_model_recipe(model_recipe()), None)
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    template = deployment["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in [port["name"] for port in container["ports"]]


@scenarios
def test_every_prometheus_operator_object_validates_against_its_published_schema(
    helm: Helm, scenario: Path, monitoring_models: MonitoringModels, tmp_path: Path
) -> None:
    objects = [obj for obj in render(helm, scenario) if obj["kind"] in MONITORING_KINDS]
    if objects:
        monitoring_models.check(objects, tmp_path)


def test_the_schema_check_rejects_an_unknown_field_and_a_wrong_type(
    helm: Helm, monitoring_models: MonitoringModels, tmp_path: Path
) -> None:
    (monitor,) = of_kind(render(helm, CHART / "ci" / "monitoring-values.yaml"), "PodMonitor")
    unknown = json.loads(json.dumps(monitor))
    unknown["spec"]["podMetricsEndpoints"][0]["pathx"] = "/metrics"
    with pytest.raises(AssertionError, match="pathx"):
        monitoring_models.check([unknown], tmp_path / "unknown")
    wrong = json.loads(json.dumps(monitor))
    wrong["spec"]["podMetricsEndpoints"][0]["port"] = 8000
    with pytest.raises(AssertionError, match="port"):
        monitoring_models.check([wrong], tmp_path / "wrong")


def test_by_default_nothing_needs_the_prometheus_operator_crds(helm: Helm) -> None:
    kinds = {obj["kind"] for obj in helm.template()}
    assert not kinds & MONITORING_KINDS


def test_every_dashboard_file_becomes_a_configmap_for_the_grafana_sidecar(helm: Helm) -> None:
    configmaps = {
        name: data
        for obj in of_kind(helm.template(), "ConfigMap")
        if obj["metadata"]["labels"].get("grafana_dashboard") == "1"
        for name, data in obj["data"].items()
    }
    files = sorted((CHART / "files" / "dashboards").glob("*.json"))
    assert sorted(configmaps) == [path.name for path in files]
    for path in files:
        assert configmaps[path.name] == path.read_text().rstrip("\n")
        assert json.loads(configmaps[path.name])["panels"]


def test_the_tier_accepts_grpc_and_data_only_from_engines_and_the_helm_test_and_metrics_from_prometheus(
    helm: Helm,
) -> None:
    policy = named(helm.template(), "NetworkPolicy", "kvtier-cache-tier")
    assert policy["spec"]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kvtier", "app.kubernetes.io/component": "cache-tier",
    }  # fmt: skip
    grpc, metrics = policy["spec"]["ingress"]
    assert grpc["ports"] == [{"port": 50051, "protocol": "TCP"}, {"port": 50052, "protocol": "TCP"}]
    components = [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in grpc["from"]]
    assert components == ["engine", "helm-test"]
    assert metrics["ports"] == [{"port": 9400, "protocol": "TCP"}]
    prometheus, operator = metrics["from"]
    assert prometheus["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    # The operator reads the tier's metrics into the CacheTier's status.traffic.
    operator_pods = named(helm.template(), "Deployment", "kvtier-operator")["spec"]["selector"]
    assert operator == {"podSelector": operator_pods}


def test_the_network_policy_opens_exactly_the_ports_the_operator_gives_a_tier(helm: Helm) -> None:
    from kvtier.operator.children import cache_tier_children
    from kvtier.operator.spec import parse_cache_tier
    from tests.operator.bodies import cache_tier

    policy = named(helm.template(), "NetworkPolicy", "kvtier-cache-tier")
    opened = {port["port"] for rule in policy["spec"]["ingress"] for port in rule["ports"]}
    children = cache_tier_children(parse_cache_tier(cache_tier()), "kvtier:test", ClusterFeatures())
    (statefulset,) = [c for c in children if c["kind"] == "StatefulSet"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert opened == {port["containerPort"] for port in container["ports"]}


def test_in_chart_redis_accepts_only_tier_pods(helm: Helm) -> None:
    objects = render(helm, CHART / "ci" / "in-chart-redis-values.yaml")
    policy = named(objects, "NetworkPolicy", "kvtier-redis")
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "kvtier", "app.kubernetes.io/component": "cache-tier",
    }}}]  # fmt: skip


@pytest.mark.parametrize("dockerfile", ["Dockerfile.server", "Dockerfile.operator"])
def test_the_kvtier_images_run_as_the_user_the_chart_pods_run_as(helm: Helm, dockerfile: str) -> None:
    text = (ROOT / "docker" / dockerfile).read_text()
    (user,) = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    deployment = named(helm.template(), "Deployment", "kvtier-operator")
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert user == f"{security['runAsUser']}:{security['runAsGroup']}"


def test_tier_tls_names_the_secret_and_the_helm_test_mounts_only_its_ca(helm: Helm) -> None:
    objects = render(helm, CHART / "ci" / "tls-values.yaml")
    (tier,) = of_kind(objects, "CacheTier")
    assert tier["spec"]["tls"] == {"secretName": "kvtier-tier-tls", "clientAuth": True}
    assert "dataPort" not in tier["spec"]  # unset: the operator decides (off for 2 replicas)
    pod = named(objects, "Pod", "kvtier-test-tier-health")["spec"]
    volumes = {v["name"]: v["secret"] for v in pod["volumes"]}
    assert volumes["tls"] == {"secretName": "kvtier-tier-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert volumes["client-tls"]["secretName"] == "kvtier-helm-test-tls"
    (tier,) = of_kind(helm.template(), "CacheTier")
    assert "tls" not in tier["spec"]


def test_the_data_port_value_sets_the_tiers_data_port(helm: Helm, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("defaultTier: {dataPort: false}\n")
    (tier,) = of_kind(helm.template(values), "CacheTier")
    assert tier["spec"]["dataPort"] == {"enabled": False}
    crdschema.validate(tier)


def test_the_ram_recycle_value_sets_the_tiers_field_and_is_unset_by_default(
    helm: Helm, tmp_path: Path
) -> None:
    (tier,) = of_kind(helm.template(), "CacheTier")
    assert "ramRecycleBytes" not in tier["spec"]  # the server's default
    values = tmp_path / "values.yaml"
    values.write_text("defaultTier: {ramRecycleBytes: 512Mi}\n")
    (tier,) = of_kind(helm.template(values), "CacheTier")
    assert tier["spec"]["ramRecycleBytes"] == "512Mi"
    crdschema.validate(tier)
    values.write_text("defaultTier: {ramRecycleBytes: lots}\n")
    result = helm.run("template", "kvtier", CHART, "--values", values, check=False)
    assert result.returncode != 0
    assert "ramRecycleBytes" in result.stdout + result.stderr  # the schema names the value


def test_mutual_tls_without_a_certificate_for_the_helm_test_fails_saying_what_to_set(
    helm: Helm, tmp_path: Path
) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("defaultTier: {tls: {secretName: t, clientAuth: true}}\n")
    result = helm.run("template", "kvtier", CHART, "--values", values, check=False)
    assert result.returncode != 0
    assert "defaultTier.tls.testClientSecretName is required when defaultTier.tls.clientAuth is true" in (
        result.stdout + result.stderr
    )


def test_the_engine_image_installs_what_every_codec_a_recipe_may_choose_needs() -> None:
    import tomllib

    from kvtier.operator.spec import CODECS

    dockerfile = (ROOT / "docker" / "Dockerfile.vllm").read_text()
    deps = tomllib.loads((ROOT / "connector" / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "pip install --no-cache-dir /tmp/kvtier/proto /tmp/kvtier/connector" in dockerfile
    assert "zstd" in CODECS and any(dep.startswith("zstandard") for dep in deps)


def test_forcing_the_data_port_on_several_replicas_without_redis_fails_saying_why(
    helm: Helm, tmp_path: Path
) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("defaultTier: {replicas: 2, dataPort: true}\n")
    result = helm.run("template", "kvtier", CHART, "--values", values, check=False)
    assert result.returncode != 0
    assert "defaultTier.dataPort: true needs Redis (redis.mode) when defaultTier.replicas is more than 1" in (
        result.stdout + result.stderr
    )
    values.write_text("defaultTier: {replicas: 2, dataPort: true}\nredis: {mode: inChart}\n")
    (tier,) = of_kind(helm.template(values), "CacheTier")
    assert tier["spec"]["dataPort"] == {"enabled": True}


def test_the_tenant_quota_value_sets_the_tiers_quota_and_is_unset_by_default(
    helm: Helm, tmp_path: Path
) -> None:
    from kvtier.operator.children import cache_tier_children
    from kvtier.operator.spec import parse_cache_tier

    (tier,) = of_kind(helm.template(), "CacheTier")
    assert "tenantQuotaBytes" not in tier["spec"]  # no quota
    values = tmp_path / "values.yaml"
    values.write_text("defaultTier: {tenantQuotaBytes: 4Gi, authSecret: {name: tenants}}\n")
    (tier,) = of_kind(helm.template(values), "CacheTier")
    assert tier["spec"]["tenantQuotaBytes"] == "4Gi"
    crdschema.validate(tier)
    # What the operator makes of it: the server's quota setting, in bytes.
    body = crdschema.with_defaults(tier)
    body["metadata"] |= {"uid": "u", "generation": 1}
    (config,) = [c for c in cache_tier_children(parse_cache_tier(body), "img", ClusterFeatures())
                 if c["kind"] == "ConfigMap"]  # fmt: skip
    assert config["data"]["KVTIER_TENANT_QUOTA_BYTES"] == str(4 << 30)
    values.write_text("defaultTier: {tenantQuotaBytes: lots}\n")
    result = helm.run("template", "kvtier", CHART, "--values", values, check=False)
    assert result.returncode != 0
    assert "tenantQuotaBytes" in result.stdout + result.stderr  # the schema names the value


def test_a_per_node_default_tier_needs_redis_and_renders_a_per_node_cachetier(
    helm: Helm, tmp_path: Path
) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("defaultTier: {topology: perNode}\n")
    result = helm.run("template", "kvtier", CHART, "--values", values, check=False)
    assert result.returncode != 0
    assert "defaultTier.topology: perNode needs Redis" in result.stdout + result.stderr
    values.write_text(
        "redis: {mode: inChart}\n"
        "defaultTier:\n  topology: perNode\n  nodeSelector: {pool: gpu}\n"
        "  tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]\n"
        "  disk: {storageClassName: local-nvme}\n"
    )
    (tier,) = of_kind(helm.template(values), "CacheTier")
    crdschema.validate(tier)
    assert tier["spec"]["topology"] == "perNode"
    assert tier["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert "storageClassName" not in tier["spec"]["disk"]  # an emptyDir on the node
    from kvtier.operator.spec import parse_cache_tier

    body = crdschema.with_defaults(tier)
    body["metadata"] |= {"uid": "u", "generation": 1}
    assert parse_cache_tier(body).spec.per_node  # what the operator accepts
