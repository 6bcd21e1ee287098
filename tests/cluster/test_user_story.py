"""The user story, on a real one-node cluster (issue 17): real pods throughout, the images the
Dockerfiles produce (built by scripts/images, never pulled), no hostNetwork, no privileged pod.

The tests run in order and share one install, one recipe and its pods (to work on one step:
``KVTIER_TEST_CLUSTER=DIR`` uses a cluster that is up, ``KVTIER_STORY_REUSE=1`` skips step 1
when it ran there already):

1. README.md's quickstart, as scripts/try-on-cluster runs it: ``helm install`` (the operator
   under the chart's RBAC, the CRDs, the default CacheTier whose pod turns Ready through its
   probes), ``helm test`` (the chart's test pod), a ModelRecipe for a tiny random-weight
   Qwen2.5-VL on a volume, the engine Ready, the same chat request with an image twice to
   the engine's Service: the repeat is served from the tier over the data port.
2. A second engine replica, never warmed, serves the same prompt from the tier.
3. Observability: Debian's Prometheus finds the tier and engine pods through Kubernetes
   service discovery, configured from the chart's PodMonitor and ServiceMonitor (Debian
   builds Prometheus without kubernetes_sd_configs: tests/cluster/discovery.py does that
   discovery from the API server into file_sd files; the relabelling is Prometheus'); the
   recipe's status follows the traffic.
4. Security as enforced: every pod non-root, read-only root filesystem, no capabilities;
   each image holds its own distribution only; another tenant's token gets no hit.
5. Faults under traffic: the tier pod deleted (every request answered, the same output; the
   disk tier's chunks survive on the claim and hits resume), an engine pod deleted (its
   replacement's first repeat is a hit), ``helm upgrade`` of the tier's RAM (the tier rolls,
   no request fails).
6. A per-node tier (issue 18): a Redis, a CacheTier with ``topology: perNode`` (a DaemonSet,
   its socket in a node-local directory) and an engine of the same recipe on it; the repeat
   is loaded over the same-node transport; no pod privileged or on the host's namespaces.
7. Every panel query of both dashboards returns data of this run; ``helm uninstall``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.testing.chat import chat
from kvtier.testing.queries import concrete, dashboards
from kvtier.testing.servers import Prometheus
from kvtier.testing.tinymodels import prompt_text
from tests.cluster import story
from tests.cluster.conftest import ROOT, Cluster
from tests.cluster.discovery import FileDiscovery
from tests.cluster.story import ENGINE_SELECTOR, MODEL, NS, RECIPE, TIER_SELECTOR, Metrics, Traffic

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.vllm]

CLUSTER_IMAGES = ("kvtier-server", "kvtier-operator", "vllm-kvtier", "kvtier-redis")
TEXT, SEED = prompt_text(400, seed=7), 7  # ~1000 prompt tokens: several 256-token chunks
OTHER_TEXT = prompt_text(400, seed=8)  # another prompt, sent only around the tier's restart
READY_S = 1500  # an engine pod on the slower machine kind, loaded (ENVIRONMENT.md)
SCRAPE = "2s"


@dataclass
class Story:
    cluster: Cluster
    script: str = ""  # scripts/try-on-cluster's output
    answer: str = ""  # the model's answer to TEXT + image SEED (greedy)
    prometheus: Prometheus | None = None
    discovery: FileDiscovery | None = None  # Kubernetes discovery for Debian's Prometheus
    started: float = field(default_factory=time.time)
    # OTHER_TEXT's answer once the tier held it, sent only before the tier pod's deletion.
    other: Any = None

    def pods(self, selector: str) -> list[dict[str, Any]]:
        out = self.cluster.kubectl("get", "pods", "-n", NS, "-l", selector, "-o", "json").stdout
        return [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]

    def ready_pods(self, selector: str) -> list[dict[str, Any]]:
        return [p for p in self.pods(selector) if _ready(p)]

    def service_url(self) -> str:
        ip = self.cluster.get("service", RECIPE, NS)["spec"]["clusterIP"]
        return f"http://{ip}:{story.ENGINE_PORT}"

    def recipe(self) -> dict[str, Any]:
        return self.cluster.get("modelrecipe", RECIPE, NS)

    def wait_engines(
        self, count: int, exclude: frozenset[str] = frozenset()
    ) -> list[dict[str, Any]]:
        return self.cluster.eventually(
            f"{count} ready engine pods",
            lambda: (
                pods
                if len(
                    pods := [
                        p
                        for p in self.ready_pods(ENGINE_SELECTOR)
                        if p["metadata"]["name"] not in exclude
                    ]
                )
                >= count
                else None
            ),
            timeout=READY_S,
        )


def _ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _metrics(pod: dict[str, Any], port: int) -> Metrics:
    return Metrics.read(pod["status"]["podIP"], port)


@pytest.fixture(scope="module")
def s(cluster: Cluster) -> Iterator[Story]:
    result = Story(cluster)
    yield result
    stop_prometheus(result)  # before the cluster goes: it talks to its addresses


def stop_prometheus(s: Story) -> None:
    if s.prometheus is not None:
        s.prometheus.stop()
        s.prometheus = None
    if s.discovery is not None:
        s.discovery.__exit__()
        s.discovery = None


# --- 1. the quickstart ---------------------------------------------------------------------


@pytest.mark.timeout(3600)
def test_the_readme_quickstart_runs_on_the_cluster(s: Story) -> None:
    """scripts/try-on-cluster: images loaded, helm install + test, the recipe Ready, two chats."""
    s.cluster.require_up()
    log = s.cluster.dir / "try-on-cluster.log"
    if os.environ.get("KVTIER_STORY_REUSE") and log.exists():  # working on later steps: ran already
        s.script = log.read_text()
    else:
        result = subprocess.run(
            [str(ROOT / "scripts" / "try-on-cluster"), str(s.cluster.dir)],
            capture_output=True, text=True, timeout=3500,
        )  # fmt: skip
        s.script = result.stdout + result.stderr
        log.write_text(s.script)
        print(s.script[-6000:])
        assert result.returncode == 0, s.script[-8000:]
    (first, second) = re.findall(
        r"request \d: (\d+) prompt tokens, (\d+) cached .*answer (.*)", s.script
    )
    assert int(first[1]) == 0 and int(second[1]) >= 256, (first, second)  # a full chunk or more
    assert first[2] == second[2]  # the same greedy answer, from the tier's KV


def test_the_readme_quickstart_is_the_sequence_the_test_ran(s: Story) -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## On Kubernetes", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    quickstart = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    ran = [line[2:] for line in s.script.splitlines() if line.startswith("+ ")]
    local = {"recipes/qwen2_5_vl.yaml": "recipes/local/tiny-qwen2_5_vl.yaml"}
    at = 0
    for command in quickstart[1:]:  # the first line puts helm on PATH
        for old, new in local.items():
            command = command.replace(old, new)
        words = command.replace('"$(openssl rand -hex 32)"', "").split()
        found = [
            i
            for i, line in enumerate(ran)
            if i >= at and all(w in line.split() or w in line for w in words)
        ]
        assert found, f"README's {command!r} was not run (after step {at}): {ran}"
        at = found[0] + 1


def test_the_operator_runs_under_the_charts_rbac(s: Story) -> None:
    (pod,) = s.ready_pods("app.kubernetes.io/component=operator")
    assert pod["status"]["phase"] == "Running"
    assert pod["spec"]["serviceAccountName"] == "kvtier-operator"
    binding = s.cluster.get("clusterrolebinding", "kvtier-operator", NS)
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvtier-operator", "namespace": NS}
    ]
    rules = s.cluster.get("clusterrole", binding["roleRef"]["name"], NS)["rules"]
    shipped = yaml.safe_load((ROOT / "operator/kvtier/operator/rbac.yaml").read_text())
    assert rules == shipped["rules"]
    who = f"system:serviceaccount:{NS}:kvtier-operator"
    can = lambda *a: s.cluster.kubectl("auth", "can-i", *a, "--as", who, check=False).stdout.strip()  # noqa: E731
    assert can("patch", "statefulsets", "-n", NS) == "yes"
    assert can("list", "pods", "-n", NS) == "yes"
    assert can("list", "secrets", "-n", NS) == "no" and can("create", "pods", "-n", NS) == "no"


def test_the_crds_and_the_default_tier_exist_and_the_tier_pod_is_ready_through_its_probes(
    s: Story,
) -> None:
    for crd in ("modelrecipes.kvtier.io", "cachetiers.kvtier.io"):
        conditions = s.cluster.get("crd", crd, NS)["status"]["conditions"]
        assert any(c["type"] == "Established" and c["status"] == "True" for c in conditions)
    tier = s.cluster.get("cachetier", story.TIER, NS)
    assert tier["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert tier["status"]["state"] == "Serving"
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in tier["status"]["conditions"])
    (pod,) = s.ready_pods(TIER_SELECTOR)
    (container,) = pod["spec"]["containers"]
    assert container["image"] == Cluster.image("kvtier-server") and container["command"] == [
        "kvtier-server"
    ]
    # Kubernetes 1.20 has no gRPC probes: the operator's TCP probe on the gRPC port, run by the kubelet.
    assert container["readinessProbe"]["tcpSocket"] == {"port": 50051}
    assert pod["status"]["containerStatuses"][0]["ready"]
    claim = s.cluster.get("pvc", f"data-{pod['metadata']['name']}", NS)
    assert claim["status"]["phase"] == "Bound"


def test_helm_test_passed_as_the_charts_own_test_pod(s: Story) -> None:
    assert re.search(r"TEST SUITE:\s+kvtier-test-tier-health", s.script)
    assert re.search(r"Phase:\s+Succeeded", s.script)
    assert f"the kvtier tier at kvtier.{NS}.svc:50051 is SERVING" in s.script
    hooks = s.cluster.helm("get", "hooks", "kvtier", "-n", NS).stdout
    (test_pod,) = [
        d
        for d in yaml.safe_load_all(hooks)
        if d and d["metadata"]["name"] == "kvtier-test-tier-health"
    ]
    assert test_pod["spec"]["containers"][0]["image"] == Cluster.image("kvtier-server")


def test_the_engine_pod_is_ready_and_the_repeat_came_from_the_tier_over_the_data_port(
    s: Story,
) -> None:
    (engine,) = s.ready_pods(ENGINE_SELECTOR)
    (container,) = engine["spec"]["containers"]
    assert container["image"] == Cluster.image("vllm-kvtier")
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    recipe = s.recipe()
    assert {c["type"]: c["status"] for c in recipe["status"]["conditions"]}["Ready"] == "True"
    m = _metrics(engine, story.ENGINE_PORT)
    assert m.get("kvtier_connector_hit_tokens_total") >= 256
    assert m.get("kvtier_connector_loaded_chunks_total") >= 1
    assert m.get("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") >= 256
    (tier,) = s.ready_pods(TIER_SELECTOR)
    t = _metrics(tier, story.TIER_METRICS_PORT)
    assert t.get("kvtier_server_requests_total", op="DataGet", code="OK") >= 1
    assert t.get("kvtier_server_requests_total", op="Get") == 0  # not gRPC: the data port
    assert t.get("kvtier_server_sent_bytes_total") > 0
    answer = chat(s.service_url(), MODEL, TEXT, SEED)  # this test's own prompt, for later steps
    s.answer = answer.text
    assert chat(s.service_url(), MODEL, TEXT, SEED).cached_tokens >= 256


# --- 2. a second replica -----------------------------------------------------------------------


def test_a_second_replica_never_warmed_serves_the_same_prompt_from_the_tier(s: Story) -> None:
    start_prometheus(s)
    (first,) = s.ready_pods(ENGINE_SELECTOR)
    s.cluster.kubectl("patch", "modelrecipe", RECIPE, "-n", NS, "--type", "merge", "-p",
                      '{"spec":{"engine":{"replicas":2}}}')  # fmt: skip
    (second,) = s.wait_engines(1, exclude=frozenset({first["metadata"]["name"]}))
    before = _metrics(second, story.ENGINE_PORT)
    assert before.get("vllm:request_success_total") == 0  # never served anything
    answer = chat(f"http://{second['status']['podIP']}:{story.ENGINE_PORT}", MODEL, TEXT, SEED)
    assert answer.cached_tokens >= 256 and answer.text == s.answer
    assert _metrics(second, story.ENGINE_PORT).get("kvtier_connector_hit_tokens_total") >= 256


# --- 3. observability ----------------------------------------------------------------------------


def start_prometheus(s: Story) -> None:
    """Debian's Prometheus on this machine, discovering the pods through the API server with a
    ServiceAccount of its own, scraping what the chart's monitors select."""
    c = s.cluster
    c.apply([
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "prometheus"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "kvtier-test-prometheus"},
         "rules": [{"apiGroups": [""], "resources": ["pods", "services", "endpoints"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "kvtier-test-prometheus"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kvtier-test-prometheus"},
         "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": NS}]},
    ], NS)  # fmt: skip
    secret = c.eventually(
        "the prometheus token", lambda: c.get("serviceaccount", "prometheus", NS).get("secrets")
    )
    token = c.get("secret", secret[0]["name"], NS)["data"]["token"]
    work = c.dir / "prometheus"
    work.mkdir(exist_ok=True)
    (work / "token").write_bytes(base64.b64decode(token))
    values = c.helm("get", "values", "kvtier", "-n", NS, "-o", "yaml").stdout
    (work / "values.yaml").write_text(values)
    rendered = c.helm("template", "kvtier", str(ROOT / "helm/kvtier"), "-n", NS, "-f", str(work / "values.yaml"),
                      "--set", "serviceMonitor.enabled=true").stdout  # fmt: skip
    monitors = [
        d
        for d in yaml.safe_load_all(rendered)
        if d and d["kind"] in ("PodMonitor", "ServiceMonitor")
    ]
    assert {m["kind"] for m in monitors} == {"PodMonitor", "ServiceMonitor"}
    jobs = story.scrape_configs(
        monitors, "https://10.244.0.1:6443", c.dir / "pki" / "ca.crt", work / "token", SCRAPE
    )
    # Debian's Prometheus lacks kubernetes_sd_configs: the same jobs, their discovery done by
    # tests/cluster/discovery.py from the API server with the same token (relabelling unchanged).
    s.discovery = FileDiscovery(work / "sd")
    config = {
        "global": {"evaluation_interval": SCRAPE},
        "scrape_configs": s.discovery.rewrite(jobs),
    }
    s.discovery.__enter__()
    tools = subprocess.run(
        ["bash", str(ROOT / "scripts/obs-env")], capture_output=True, text=True, timeout=900
    )
    assert tools.returncode == 0, tools.stderr
    binary = dict(line.split("=", 1) for line in tools.stdout.splitlines() if "=" in line)[
        "PROMETHEUS"
    ]
    s.prometheus = Prometheus.start_with_config(work, config, binary=binary)
    s.started = time.time()


def test_prometheus_discovers_and_scrapes_the_tier_and_engine_pods(s: Story) -> None:
    assert s.prometheus is not None
    pods = {
        p["metadata"]["name"] for p in s.ready_pods(ENGINE_SELECTOR) + s.ready_pods(TIER_SELECTOR)
    }

    def scraped() -> list[dict[str, Any]] | None:
        up = [t for t in s.prometheus.targets() if t["health"] == "up"]  # type: ignore[union-attr]
        return up if pods <= {t["labels"].get("pod") for t in up} else None

    targets = s.cluster.eventually("every tier and engine pod scraped", scraped, timeout=120)
    assert s.discovery is not None and not s.discovery.errors, s.discovery.errors
    for target in targets:
        meta = target["discoveredLabels"]
        assert meta["__meta_kubernetes_namespace"] == NS  # found through the API server
        assert target["scrapeUrl"].startswith(f"http://{meta['__meta_kubernetes_pod_ip']}:")
    jobs = {t["scrapePool"] for t in targets}
    assert jobs == {
        "podmonitor/kvtier/kvtier-engine/0",
        "servicemonitor/kvtier/kvtier-cache-tier/0",
    }
    s.prometheus.wait_scraped(
        f'kvtier_connector_hit_tokens_total{{namespace="{NS}",model_name="{MODEL}"}} > 0'
    )
    s.prometheus.wait_scraped(f'kvtier_server_lookup_hit_keys_total{{namespace="{NS}"}} > 0')


def test_the_recipe_status_reports_hit_rate_tokens_served_and_the_tier_state_as_traffic_flows(
    s: Story,
) -> None:
    def traffic() -> dict[str, Any] | None:
        t = s.recipe().get("status", {}).get("traffic", {})
        return (
            t
            if t.get("engines") == 2 and t.get("state") == "Known" and "tokensServed" in t
            else None
        )

    before = s.cluster.eventually("status.traffic of both engines", traffic, timeout=120)
    assert before["tierState"] == "Serving" and 0 < before["chunkHitRate"] <= 1
    assert chat(s.service_url(), MODEL, TEXT, SEED).cached_tokens >= 256
    after = s.cluster.eventually(
        "tokensServed to grow", lambda: (t if (t := traffic()) and t["tokensServed"] > before["tokensServed"] else None),
        timeout=120,
    )  # fmt: skip
    assert (
        after["hitChunks"] > before["hitChunks"] and after["lookupChunks"] > before["lookupChunks"]
    )
    assert after["chunkHitRate"] == round(after["hitChunks"] / after["lookupChunks"], 4)


# --- 4. security, as enforced ----------------------------------------------------------------------

# Run in each pod's main container: what the kernel says about PID 1, and a write to the root.
SELF = """
import json, os
status = dict(line.split(":", 1) for line in open("/proc/1/status").read().splitlines() if ":" in line)
root = [l.split() for l in open("/proc/1/mounts") if l.split()[1] == "/"][-1]
try:
    open("/kvtier-write-test", "w")
    write = "written"
except OSError as exc:
    write = exc.strerror
print(json.dumps({"uid": status["Uid"].split(), "gid": status["Gid"].split(),
    "caps": {k: int(status[k], 16) for k in ("CapPrm", "CapEff", "CapBnd", "CapAmb")},
    "no_new_privs": status["NoNewPrivs"].strip(), "seccomp": status["Seccomp"].strip(),
    "root": root[3].split(","), "write": write}))
"""
COMPONENTS = {
    "operator": "app.kubernetes.io/component=operator",
    "tier": TIER_SELECTOR,
    "engine": ENGINE_SELECTOR,
}


def _in_pod(s: Story, pod: dict[str, Any], script: str, timeout: float = 300) -> dict[str, Any]:
    result = s.cluster.kubectl("exec", pod["metadata"]["name"], "-n", NS, "--", "python3", "-c", script,
                               timeout=timeout)  # fmt: skip
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_every_pod_runs_non_root_on_a_read_only_root_with_no_capabilities(s: Story) -> None:
    seen = []
    for component, selector in COMPONENTS.items():
        for pod in s.ready_pods(selector):
            spec = pod["spec"]
            assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
            (container,) = spec["containers"]
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
            assert security["capabilities"] == {"drop": ["ALL"]} and not security.get("privileged")
            uid = spec["securityContext"]["runAsUser"]
            assert uid != 0 and spec["securityContext"]["runAsNonRoot"]
            # What the kernel enforces on the running process:
            proc = _in_pod(s, pod, SELF)
            assert proc["uid"] == [str(uid)] * 4, (component, proc)
            assert proc["caps"] == {"CapPrm": 0, "CapEff": 0, "CapBnd": 0, "CapAmb": 0}, (
                component,
                proc,
            )
            assert proc["no_new_privs"] == "1" and proc["seccomp"] == "2", (
                component,
                proc,
            )  # RuntimeDefault
            assert "ro" in proc["root"] and proc["write"] == "Read-only file system", (
                component,
                proc,
            )
            seen.append(component)
    assert sorted(set(seen)) == ["engine", "operator", "tier"] and seen.count("engine") == 2


IMPORTS = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        found[name] = True
    except ImportError:
        found[name] = False
print(json.dumps(found))
"""
# Each image holds one distribution and what it needs (issue 16): what imports, what must not.
CONTENTS = {
    # The engine's C helpers too: Dockerfile.vllm builds them, and without them keys and
    # the NaN scan fall back to slower Python.
    "engine": ({"kvtier.connector.vllm", "kvtier.connector.ec",
                "kvtier.connector.chunks._keyhash", "kvtier.connector.chunks._finite"},
               {"redis", "kopf", "kvtier.cacheserver", "kvtier.operator"}),
    "tier": ({"kvtier.cacheserver.server"},
             {"kopf", "vllm", "torch", "kvtier.connector", "kvtier.operator"}),
    "operator": ({"kvtier.operator.main"},
                 {"redis", "grpc", "kvtier.proto", "kvtier.cacheserver"}),
}  # fmt: skip


@pytest.mark.parametrize("component", sorted(CONTENTS))
def test_each_image_holds_only_its_own_distribution(s: Story, component: str) -> None:
    present, absent = CONTENTS[component]
    pod = s.ready_pods(COMPONENTS[component])[0]
    found = _in_pod(
        s, pod, IMPORTS.replace("sys.argv[1:]", repr(sorted(present | absent))), timeout=600
    )
    assert found == {**dict.fromkeys(present, True), **dict.fromkeys(absent, False)}


TENANT_PROBE = """
import json, sys
from kvtier.connector.client import TierClient
keys = [bytes.fromhex(k) for k in sys.argv[1].split(",")]
out = {}
for name, token in (("mounted", open("/etc/kvtier/auth/token").read().strip()), ("forged", "f" * 32)):
    try:
        with TierClient("kvtier.kvtier.svc:50051", token=token, timeout_s=30) as client:
            out[name] = sum(v is not None for v in client.get(keys, stop_at_first_miss=False))
    except Exception as exc:
        out[name] = {"error": type(exc).__name__, "code": getattr(exc, "code", None), "message": str(exc)}
print(json.dumps(out))
"""


def _tenant_pod(s: Story, tenant: str, keys: list[bytes]) -> dict[str, Any]:
    """A pod of the engine image with one tenant's token (as the operator mounts it), asking the
    tier for ``keys`` over its Service; its answer."""
    name = f"tenant-{tenant}"
    s.cluster.apply([{
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never", "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000},
            "containers": [{
                "name": "probe", "image": Cluster.image("vllm-kvtier"), "imagePullPolicy": "Never",
                "command": ["python3", "-c", TENANT_PROBE, ",".join(k.hex() for k in keys)],
                "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "token", "mountPath": "/etc/kvtier/auth", "readOnly": True}],
            }],
            "volumes": [{"name": "token", "secret": {"secretName": "tier-auth",
                                                     "items": [{"key": tenant, "path": "token"}]}}],
        },
    }], NS)  # fmt: skip
    s.cluster.eventually(
        f"pod {name} done",
        lambda: s.cluster.get("pod", name, NS)["status"].get("phase") in ("Succeeded", "Failed"),
        timeout=300,
    )
    logs = s.cluster.kubectl("logs", name, "-n", NS).stdout
    s.cluster.kubectl("delete", "pod", name, "-n", NS, "--wait=false")
    return json.loads(logs.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_another_tenants_token_gets_no_hit(s: Story) -> None:
    """The engines' entries (tenant "default", read from the tier's disk volume) are found with
    the default tenant's token, not with team-b's, and a forged token is refused."""
    (tier,) = s.ready_pods(TIER_SELECTOR)
    claim = s.cluster.get("pvc", f"data-{tier['metadata']['name']}", NS)
    volume = s.cluster.get("pv", claim["spec"]["volumeName"], NS)["spec"]["hostPath"]["path"]
    held = story.disk_keys(Path(volume))
    assert set(held) == {"default"} and len(held["default"]) >= 2, {
        k: len(v) for k, v in held.items()
    }
    keys = held["default"][:32]
    owner, other = _tenant_pod(s, "default", keys), _tenant_pod(s, "team-b", keys)
    assert owner["mounted"] == len(keys)  # positive control: the same keys, the right token
    assert other["mounted"] == 0
    for answer in (owner, other):
        assert answer["forged"]["code"] == "UNAUTHENTICATED", answer


# --- 5. faults under traffic -----------------------------------------------------------------------


def _tier_replaced(s: Story, old_uid: str) -> dict[str, Any]:
    """The tier's pod once a new one (another UID) is Ready."""
    return s.cluster.eventually(  # type: ignore[no-any-return]
        "a new tier pod Ready",
        lambda: next(
            (p for p in s.ready_pods(TIER_SELECTOR) if p["metadata"]["uid"] != old_uid), None
        ),
        timeout=READY_S,
    )


def _hit_after(t: float) -> Any:
    return lambda sent: any(x.at > t and x.answer and x.answer.cached_tokens >= 256 for x in sent)


def _settled_hit(url: str) -> Any:
    """A probe sending OTHER_TEXT: its answer once two in a row loaded the same number of
    tokens (at least a chunk) from the tier (the engine saves a request's chunks after its
    reply)."""
    last = [-1]

    def probe() -> Any:
        answer = chat(url, MODEL, OTHER_TEXT, SEED)
        settled = answer.cached_tokens >= 256 and answer.cached_tokens == last[0]
        last[0] = answer.cached_tokens
        return answer if settled else None

    return probe


def _all_answered_alike(s: Story, traffic: Traffic) -> None:
    failed = [x.error for x in traffic.sent if x.answer is None]
    assert not failed, f"{len(failed)} of {len(traffic.sent)} requests failed: {failed[:3]}"
    assert {x.answer.text for x in traffic.sent if x.answer} == {s.answer}


def test_the_tier_pod_deleted_mid_traffic_every_request_answers_and_hits_resume_from_its_disk(
    s: Story,
) -> None:
    """Traffic runs through the tier pod's deletion: every request answers alike, recomputed
    while the tier is away, hits once it is back. The new pod starts with the disk tier its
    claim kept (its entries, its log). That the disk serves them is the next test's: a
    request sent only before the fault (so nothing put its chunks again into the new pod's
    empty RAM) to an engine that never saw it. (Here, the engines' own prefix caches answer
    that request, and the traffic's hits after the fault may come from RAM: a recomputed
    request can store its chunks again before the next one reads them.)"""
    (tier,) = s.ready_pods(TIER_SELECTOR)
    url = s.service_url()
    disk_only = chat(url, MODEL, OTHER_TEXT, SEED)
    again = s.cluster.eventually("the other prompt held whole by the tier", _settled_hit(url))
    assert again.text == disk_only.text
    s.other = again
    s.cluster.eventually(  # the write-behind queue drained: its chunks are on the disk too
        "the tier's write-behind queue empty",
        lambda: _metrics(tier, story.TIER_METRICS_PORT).get("kvtier_write_behind_queue_depth") == 0,
    )
    held = _metrics(tier, story.TIER_METRICS_PORT).get("kvtier_tier_entries", tier="disk")
    assert held > 0
    with Traffic(url, TEXT, SEED) as traffic:
        traffic.wait_for("a hit before the fault", _hit_after(0), timeout_s=300)
        gone = time.time()
        s.cluster.kubectl("delete", "pod", tier["metadata"]["name"], "-n", NS, "--wait=false")
        new = _tier_replaced(s, tier["metadata"]["uid"])
        back = time.time()
        recovered = _metrics(new, story.TIER_METRICS_PORT)
        traffic.wait_for("a hit once the tier is back", _hit_after(back), timeout_s=600)
    _all_answered_alike(s, traffic)
    during = [x.answer for x in traffic.sent if gone < x.at < back and x.answer]
    assert any(a.cached_tokens == 0 for a in during), traffic.summary()  # recomputed meanwhile
    # The StatefulSet's claim kept the disk tier: the new pod started with its entries ...
    assert recovered.get("kvtier_tier_entries", tier="disk") >= held
    assert recovered.get("kvtier_tier_entries", tier="ram") == 0
    log = s.cluster.kubectl("logs", new["metadata"]["name"], "-n", NS).stdout
    assert int(re.search(r"disk tier at /var/lib/kvtier: (\d+) entries", log).group(1)) >= held  # type: ignore[union-attr]


def test_an_engine_pod_deleted_its_replacements_first_repeat_is_a_tier_hit(s: Story) -> None:
    """The replacement engine has no prefix cache of its own: its hits are the tier's. Its
    first request is the one sent only before the tier pod's deletion: the tier pod started
    since holds it on its disk alone, so the hit is read from the disk and promoted to RAM."""
    assert s.other is not None, "needs the tier-pod-deleted test before it"
    old = s.ready_pods(ENGINE_SELECTOR)
    assert len(old) == 2
    s.cluster.kubectl("delete", "pod", old[0]["metadata"]["name"], "-n", NS, "--wait=false")
    (new,) = s.wait_engines(1, exclude=frozenset(p["metadata"]["name"] for p in old))
    assert _metrics(new, story.ENGINE_PORT).get("vllm:request_success_total") == 0
    engine = f"http://{new['status']['podIP']}:{story.ENGINE_PORT}"
    (tier,) = s.ready_pods(TIER_SELECTOR)
    before = _metrics(tier, story.TIER_METRICS_PORT)
    other = chat(engine, MODEL, OTHER_TEXT, SEED)
    assert other.cached_tokens >= 256 and other.text == s.other.text
    after = _metrics(tier, story.TIER_METRICS_PORT)
    for series, tier_name in (("kvtier_tier_hits_total", "disk"), ("kvtier_tier_promotions_total", "ram")):
        assert after.get(series, tier=tier_name) - before.get(series, tier=tier_name) >= 1, series
    answer = chat(engine, MODEL, TEXT, SEED)
    assert answer.cached_tokens >= 256 and answer.text == s.answer


def test_helm_upgrade_of_the_tiers_ram_rolls_the_tier_with_no_failed_request(s: Story) -> None:
    (tier,) = s.ready_pods(TIER_SELECTOR)
    ram = 384 << 20
    s.wait_engines(2)
    with Traffic(s.service_url(), TEXT, SEED) as traffic:
        traffic.wait_for("a hit before the upgrade", _hit_after(0), timeout_s=300)
        s.cluster.helm("upgrade", "kvtier", str(ROOT / "helm/kvtier"), "-n", NS, "--reuse-values",
                       "--set", "defaultTier.ramBytes=384Mi", "--wait", "--timeout", "10m")  # fmt: skip
        new = _tier_replaced(s, tier["metadata"]["uid"])
        back = time.time()
        s.cluster.eventually(
            "the new RAM size served",
            lambda: (
                _metrics(new, story.TIER_METRICS_PORT).get("kvtier_tier_capacity_bytes", tier="ram")
                == ram
            ),
        )
        traffic.wait_for("a hit after the roll", _hit_after(back), timeout_s=600)
    _all_answered_alike(s, traffic)
    assert s.cluster.get("configmap", "kvtier-settings", NS)["data"]["KVTIER_RAM_BYTES"] == str(ram)
    assert s.cluster.get("cachetier", story.TIER, NS)["spec"]["ramBytes"] == "384Mi"


# --- 6. a per-node tier (issue 18) ---------------------------------------------------------------

LOCAL_TIER, LOCAL_RECIPE = "local", "tiny-vl-local"
LOCAL_TIER_SELECTOR = f"app.kubernetes.io/component=cache-tier,kvtier.io/cachetier={LOCAL_TIER}"
LOCAL_ENGINE_SELECTOR = f"app.kubernetes.io/component=engine,kvtier.io/modelrecipe={LOCAL_RECIPE}"
REDIS_LABELS = {"app.kubernetes.io/name": "redis", "app.kubernetes.io/part-of": "kvtier-test"}


def _redis() -> list[dict[str, Any]]:
    """The Redis a per-node tier needs (tests/cluster/redis/Dockerfile): a Deployment and
    its Service, restricted like every pod of the story."""
    container = {
        "name": "redis", "image": Cluster.image("kvtier-redis"), "imagePullPolicy": "Never",
        "ports": [{"name": "redis", "containerPort": 6379}],
        "readinessProbe": {"tcpSocket": {"port": 6379}, "periodSeconds": 2},
        "resources": {"limits": {"memory": "512Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }  # fmt: skip
    pod = {
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
    }  # fmt: skip
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "redis", "labels": REDIS_LABELS},
         "spec": {"replicas": 1, "selector": {"matchLabels": REDIS_LABELS},
                  "template": {"metadata": {"labels": REDIS_LABELS}, "spec": pod}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "redis", "labels": REDIS_LABELS},
         "spec": {"selector": REDIS_LABELS, "ports": [{"name": "redis", "port": 6379, "targetPort": 6379}]}},
    ]  # fmt: skip


def _local_recipe() -> dict[str, Any]:
    """The quickstart's recipe, renamed, on the per-node tier."""
    recipe: dict[str, Any] = yaml.safe_load((ROOT / "recipes/local/tiny-qwen2_5_vl.yaml").read_text())
    recipe["metadata"] = {"name": LOCAL_RECIPE}
    recipe["spec"]["tier"] = {"ref": {"name": LOCAL_TIER}}
    return recipe


@pytest.mark.timeout(2400)  # an engine pod and the tier's DaemonSet pod start
def test_a_per_node_tier_serves_its_nodes_engine_over_the_socket_with_no_privileged_pod(
    s: Story,
) -> None:
    """A CacheTier with ``topology: perNode`` (a DaemonSet, its socket in a node-local
    directory, values below RAM in Redis) and an engine of the same recipe on it: the
    engine's repeat is a hit loaded over the same-node transport (the tier answers LocalGet,
    never the data port or gRPC), the same greedy answer as the shared tier's engines, and
    no pod is privileged or shares the host's network, IPC or PID namespace."""
    s.cluster.kubectl("get", "namespace", NS)
    load = subprocess.run([str(ROOT / "scripts" / "images"), "load", str(s.cluster.dir), "kvtier-redis"],
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert load.returncode == 0, load.stderr[-4000:]
    tier = {
        "apiVersion": "kvtier.io/v1alpha1", "kind": "CacheTier", "metadata": {"name": LOCAL_TIER},
        "spec": {"topology": "perNode", "redis": {"url": f"redis://redis.{NS}.svc:6379/0"},
                 "ramBytes": "256Mi"},
    }  # fmt: skip
    try:
        s.cluster.apply([*_redis(), tier, _local_recipe()], NS)
        (engine,) = s.cluster.eventually(
            "the per-node tier's engine Ready",
            lambda: s.ready_pods(LOCAL_ENGINE_SELECTOR) or None,
            timeout=READY_S,
        )
        (tier_pod,) = s.cluster.eventually(
            "the per-node tier's pod Ready", lambda: s.ready_pods(LOCAL_TIER_SELECTOR) or None
        )
        # The workloads as the operator rendered them, as the node runs them.
        daemonset = s.cluster.get("daemonset", LOCAL_TIER, NS)
        assert tier_pod["metadata"]["ownerReferences"][0]["uid"] == daemonset["metadata"]["uid"]
        for pod in (tier_pod, engine):
            spec = pod["spec"]
            assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), pod["metadata"]["name"]
            for c in spec.get("initContainers", []) + spec["containers"]:
                assert not c.get("securityContext", {}).get("privileged"), c["name"]
            (socket_dir,) = [v for v in spec["volumes"] if "hostPath" in v]
            assert socket_dir["hostPath"]["path"] == f"/var/run/kvtier/{NS}/{LOCAL_TIER}"
        (init,) = tier_pod["spec"]["initContainers"]
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
        assert 65532 in engine["spec"]["securityContext"]["supplementalGroups"]
        assert Path(f"/var/run/kvtier/{NS}/{LOCAL_TIER}/tier.sock").is_socket()  # this machine is the node

        url = f"http://{engine['status']['podIP']}:{story.ENGINE_PORT}"
        first = chat(url, MODEL, TEXT, SEED)
        again = s.cluster.eventually(  # the engine stores a request's chunks after its reply
            "a repeat served from the per-node tier",
            lambda: (a if (a := chat(url, MODEL, TEXT, SEED)).cached_tokens >= 256 else None),
            timeout=120,
        )
        reference = s.answer or chat(s.service_url(), MODEL, TEXT, SEED).text
        assert first.cached_tokens == 0 and first.text == again.text == reference
        t = _metrics(tier_pod, story.TIER_METRICS_PORT)
        assert t.get("kvtier_server_requests_total", op="LocalGet", code="OK") >= 1
        assert t.get("kvtier_server_requests_total", op="LocalPut", code="OK") >= 1
        for op in ("DataGet", "DataPut", "Get", "Put"):  # neither the data port nor gRPC
            assert t.get("kvtier_server_requests_total", op=op) == 0, op
        e = _metrics(engine, story.ENGINE_PORT)
        assert e.get("kvtier_connector_loaded_chunks_total") >= 1
        # The values reach the Redis every node's tier shares (written behind RAM). A Redis
        # write past its deadline on a busy machine drops what waits to be written: each
        # try sends another prompt, whose chunks are written again.
        prompts = iter(range(100, 200))

        def in_redis() -> bool:
            if int(s.cluster.exec("deploy/redis", NS, "redis-cli", "dbsize").stdout) > 0:
                return True
            chat(url, MODEL, prompt_text(400, seed=next(prompts)), SEED)
            return False

        try:
            s.cluster.eventually("the per-node tier's values in Redis", in_redis, timeout=120)
        except AssertionError:
            m = _metrics(tier_pod, story.TIER_METRICS_PORT)
            raise AssertionError(
                f"nothing in Redis; the tier's Redis healthy={m.get('kvtier_tier_healthy', tier='redis')}, "
                f"errors={m.get('kvtier_tier_errors_total', tier='redis')}"
            ) from None
    finally:
        for args in (("modelrecipe", LOCAL_RECIPE), ("cachetier", LOCAL_TIER),
                     ("deployment,service", "-l", "app.kubernetes.io/part-of=kvtier-test")):  # fmt: skip
            # a delete that hangs does not stop the next one; the pods' check below reports it
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.cluster.kubectl("delete", *args, "-n", NS, "--wait=true", "--timeout=300s",
                                  check=False, timeout=400)  # fmt: skip
    s.cluster.eventually(
        "the per-node tier's and its engine's pods gone",
        lambda: not s.pods(LOCAL_TIER_SELECTOR) and not s.pods(LOCAL_ENGINE_SELECTOR),
        timeout=300,
    )


# --- 7. every panel, then uninstall ---------------------------------------------------------------

# Series a healthy run never creates: labelled counters that appear on their first failure.
FAILURE_ONLY = {
    "kvtier_tier_errors_total": "a storage tier's I/O failing (disk full, Redis down)",
    "kvtier_write_behind_dropped_total": "the write-behind queue full",
    "kvtier_connector_corrupt_chunks_total": "a chunk failing verification",
    # The tier pod deleted mid-traffic fails a load only when one is in flight at the kill.
    "kvtier_connector_load_failed_blocks_total": "a load failing (its tier gone mid-load)",
}


def test_every_dashboard_panel_query_returns_data_from_this_run(s: Story) -> None:
    assert s.prometheus is not None
    # Gauge panels read the latest sample: the tier pod the last roll started must be found
    # (discovery) and scraped first (a fresh-machine run queried before it was: no data).
    (tier,) = s.ready_pods(TIER_SELECTOR)
    s.prometheus.wait_scraped(
        f'kvtier_server_serving{{namespace="{NS}",instance=~"{tier["status"]["podIP"]}:.*"}}',
        timeout_s=120,
    )
    window = f"{int(time.time() - s.started) + 10}s"  # everything since Prometheus started
    empty, seen = [], set()
    for stem, title, expr in story.panel_targets(dashboards()):
        if s.prometheus.query(concrete(expr, rate_interval=window, range_=window)):
            seen.add((stem, title))
        else:
            empty.append((stem, title, expr))
    panels = {(stem, title) for stem, title, _ in story.panel_targets(dashboards())}
    print("queries with no data:", *empty, sep="\n  ")
    assert panels == seen, f"panels with no data: {sorted(panels - seen)}"
    unexplained = [e for e in empty if not any(name in e[2] for name in FAILURE_ONLY)]
    assert not unexplained, unexplained


def test_helm_uninstall_removes_what_the_chart_made_but_crds_and_the_tiers_claim(s: Story) -> None:
    manifest = [
        d
        for d in yaml.safe_load_all(s.cluster.helm("get", "manifest", "kvtier", "-n", NS).stdout)
        if d
    ]
    assert s.prometheus is not None
    stop_prometheus(s)  # its targets are about to go
    s.cluster.helm("uninstall", "kvtier", "-n", NS, "--wait", "--timeout", "5m")
    gone = [(d["kind"], d["metadata"]["name"]) for d in manifest]
    gone += [("cachetier", story.TIER), ("statefulset", story.TIER), ("service", story.TIER),
             ("service", f"{story.TIER}-headless"), ("configmap", f"{story.TIER}-settings")]  # fmt: skip
    for kind, name in gone:  # the chart's objects, and what the operator made for its CacheTier
        s.cluster.eventually(
            f"{kind} {name} deleted",
            lambda kind=kind, name=name: (
                s.cluster.kubectl("get", kind, name, "-n", NS, check=False).returncode != 0
            ),
            timeout=180,
        )
    assert "kvtier" not in s.cluster.helm("list", "-n", NS, "-q").stdout.split()
    # Helm never deletes crds/: the CRDs, and so the user's ModelRecipe, stay.
    for crd in ("modelrecipes.kvtier.io", "cachetiers.kvtier.io"):
        s.cluster.get("crd", crd, NS)
    assert s.recipe()["metadata"]["name"] == RECIPE
    # Kubernetes keeps a StatefulSet's claims: the tier's disk (and its chunks) stay until deleted.
    assert s.cluster.get("pvc", f"data-{story.TIER}-0", NS)["status"]["phase"] == "Bound"
    # With the operator gone, kopf's finalizer keeps a deleted recipe Terminating (documented in
    # docs/operator.md and helm/kvtier/README.md, "Uninstalling"); removing it by hand, as the
    # docs say, lets it go, and its engines with it (owner references).
    s.cluster.kubectl("delete", "modelrecipe", RECIPE, "-n", NS, "--wait=false")
    terminating = s.recipe()["metadata"]
    assert terminating.get("deletionTimestamp") and "kvtier.io/finalizer" in terminating["finalizers"]
    s.cluster.kubectl("patch", "modelrecipe", RECIPE, "-n", NS, "--type", "merge", "-p",
                      '{"metadata":{"finalizers":null}}')  # fmt: skip
    for kind in ("modelrecipe", "deployment"):
        s.cluster.eventually(
            f"{kind} {RECIPE} deleted",
            lambda kind=kind: (
                s.cluster.kubectl("get", kind, RECIPE, "-n", NS, check=False).returncode != 0
            ),
            timeout=180,
        )
    s.cluster.kubectl("delete", "pvc", f"data-{story.TIER}-0", "models", "-n", NS, "--wait=false")
