"""The one-node cluster really runs pods (scripts/cluster, scripts/images; docs/cluster.md).

On a real kubelet + containerd + runc node, with an image built here from a Dockerfile
(tests/cluster/probe) and never pulled: a pod passes its readiness probe and runs as
non-root on a read-only root filesystem; another pod resolves a Service by its DNS name and
reaches it through its ClusterIP (and a StatefulSet pod by its name under a headless
Service); a claim of the default StorageClass binds and its data outlives the pod; a pod's
ServiceAccount token gets it what RBAC grants, and only that, from
https://kubernetes.default.svc. The session fixture then tears the cluster down and
requires ``scripts/cluster check-clean`` to pass.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import CLUSTER, Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PROBE = "kvtier-probe"
UID = 65532


def probe_pod(
    name: str,
    *,
    labels: dict[str, str] | None = None,
    readiness_port: int = 8080,
    service_account: str | None = None,
    volumes: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod of the probe image: non-root, read-only root filesystem, no capabilities."""
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 2,
        "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID},
        "containers": [
            {
                "name": "probe",
                "image": Cluster.image(PROBE),
                "imagePullPolicy": "Never",
                "ports": [{"containerPort": 8080}],
                "readinessProbe": {
                    "httpGet": {"path": "/healthz", "port": readiness_port},
                    "periodSeconds": 1,
                },
                "securityContext": {
                    "readOnlyRootFilesystem": True,
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": [
                    {"name": claim, "mountPath": path} for claim, path in (volumes or {}).items()
                ],
            }
        ],
        "volumes": [
            {"name": claim, "persistentVolumeClaim": {"claimName": claim}}
            for claim in (volumes or {})
        ],
    }
    if service_account:
        spec["serviceAccountName"] = service_account
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": spec,
    }


def probe(cluster: Cluster, pod: str, namespace: str, *args: str, check: bool = True) -> str:
    result = cluster.exec(pod, namespace, "python3", "/app/probe.py", *args, check=check)
    return result.stdout.strip() if check else result.stdout + result.stderr


@pytest.fixture(scope="module")
def web(cluster: Cluster, namespace: str) -> str:
    """A Ready probe pod behind the Service ``web``."""
    cluster.apply(
        [
            probe_pod("web"),
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "web"},
                "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
            },
        ],
        namespace,
    )
    cluster.wait_ready("web", namespace)
    return "web"


@pytest.fixture(scope="module")
def client(cluster: Cluster, namespace: str) -> str:
    """A second probe pod, for requests from inside the cluster."""
    cluster.apply([probe_pod("client")], namespace)
    cluster.wait_ready("client", namespace)
    return "client"


def test_pod_from_local_image_is_ready_non_root_read_only(
    cluster: Cluster, namespace: str, web: str
) -> None:
    pod = cluster.get("pod", web, namespace)
    (status,) = pod["status"]["containerStatuses"]
    assert status["ready"] and "running" in status["state"]
    assert status["image"] == Cluster.image(PROBE)
    assert pod["spec"]["nodeName"] == "localhost"
    assert pod["status"]["podIP"].startswith("10.244.0.")

    assert probe(cluster, web, namespace, "get", "http://127.0.0.1:8080/") == f"web uid={UID}"
    assert cluster.exec(web, namespace, "id", "-u").stdout.strip() == str(UID)
    denied = probe(cluster, web, namespace, "write", "/app/x", "y", check=False)
    assert "Read-only file system" in denied
    # The pod resolves names with the cluster DNS only, never this machine's nameserver.
    resolv = cluster.exec(web, namespace, "cat", "/etc/resolv.conf").stdout
    assert "nameserver 10.244.0.1" in resolv
    assert resolv.count("nameserver") == 1
    # No route out of the cluster's ranges: nothing is sent (TEST-NET-3, the metadata address).
    for address in ("203.0.113.1", "169.254.169.254"):
        out = probe(cluster, web, namespace, "get", f"http://{address}/", check=False)
        assert "Network is unreachable" in out, out


def test_readiness_probe_gates_readiness(cluster: Cluster, namespace: str) -> None:
    """Negative control: the same pod probed on a port nobody listens on runs but never turns Ready."""
    cluster.apply([probe_pod("unready", readiness_port=9999)], namespace)
    cluster.eventually(
        "the unready pod running",
        lambda: (
            cluster.get("pod", "unready", namespace)["status"]
            .get("containerStatuses", [{}])[0]
            .get("state", {})
            .get("running")
        ),
    )
    result = cluster.kubectl(
        "wait", "--for=condition=Ready", "pod/unready", "-n", namespace, "--timeout=5s", check=False
    )
    assert result.returncode != 0
    (status,) = cluster.get("pod", "unready", namespace)["status"]["containerStatuses"]
    assert not status["ready"]
    cluster.kubectl("delete", "pod", "unready", "-n", namespace, "--wait=false")


def test_images_are_never_pulled(cluster: Cluster, namespace: str) -> None:
    """A pull goes to the refusing proxy containerd runs with: nothing leaves the machine."""
    pod = probe_pod("puller")
    pod["spec"]["containers"][0].update(
        image="docker.io/library/busybox:1.36", imagePullPolicy="Always", readinessProbe=None
    )
    cluster.apply([pod], namespace)
    message = cluster.eventually(
        "the pull refused",
        lambda: " ".join(
            e.get("message", "")
            for e in json.loads(
                cluster.kubectl(
                    "get",
                    "events",
                    "-n",
                    namespace,
                    "--field-selector",
                    "involvedObject.name=puller",
                    "-o",
                    "json",
                ).stdout
            )["items"]
            if "Failed to pull" in e.get("message", "")
        ),
    )
    assert "127.0.0.1:9" in message and "connection refused" in message, message
    cluster.kubectl("delete", "pod", "puller", "-n", namespace, "--wait=false")


def test_service_by_dns_name_through_cluster_ip(
    cluster: Cluster, namespace: str, web: str, client: str
) -> None:
    cluster_ip = cluster.get("service", "web", namespace)["spec"]["clusterIP"]
    assert cluster_ip.startswith("10.96.")
    fqdn = f"web.{namespace}.svc.cluster.local"
    for name in ("web", f"web.{namespace}", fqdn):
        resolved = cluster.eventually(
            f"{name} in the cluster DNS",
            lambda name=name: (
                probe(cluster, client, namespace, "resolve", name, check=False).strip()
                == cluster_ip
            ),
        )
        assert resolved
    # Through the ClusterIP (kube-proxy's iptables rules), by name and by address.
    assert probe(cluster, client, namespace, "get", "http://web/") == f"web uid={UID}"
    assert probe(cluster, client, namespace, "get", f"http://{cluster_ip}/") == f"web uid={UID}"
    # Names outside the cluster are refused, not forwarded anywhere.
    out = probe(cluster, client, namespace, "resolve", "deb.debian.org", check=False)
    assert "10." not in out and ("gaierror" in out or "resolution" in out), out


def test_headless_service_resolves_statefulset_pod_names(
    cluster: Cluster, namespace: str, client: str
) -> None:
    pod = probe_pod("db", labels={"app": "db"})
    cluster.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "db"},
                "spec": {
                    "clusterIP": "None",
                    "selector": {"app": "db"},
                    "ports": [{"port": 8080}],
                },
            },
            {
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "metadata": {"name": "db"},
                "spec": {
                    "serviceName": "db",
                    "replicas": 1,
                    "selector": {"matchLabels": {"app": "db"}},
                    "template": {"metadata": {"labels": {"app": "db"}}, "spec": pod["spec"]},
                },
            },
        ],
        namespace,
    )
    cluster.eventually(
        "pod db-0",
        lambda: cluster.kubectl("get", "pod", "db-0", "-n", namespace, check=False).returncode == 0,
    )
    cluster.wait_ready("db-0", namespace)
    pod_ip = cluster.get("pod", "db-0", namespace)["status"]["podIP"]
    for name in ("db-0.db", f"db-0.db.{namespace}.svc.cluster.local", "db"):
        cluster.eventually(
            f"{name} -> {pod_ip}",
            lambda name=name: (
                probe(cluster, client, namespace, "resolve", name, check=False).strip() == pod_ip
            ),
        )
    assert probe(cluster, client, namespace, "get", "http://db-0.db:8080/") == f"db-0 uid={UID}"


def test_claim_of_default_storage_class_outlives_its_pod(cluster: Cluster, namespace: str) -> None:
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "16Mi"}}},
    }
    cluster.apply([claim, probe_pod("writer", volumes={"data": "/data"})], namespace)
    cluster.wait_ready("writer", namespace)
    pvc = cluster.get("pvc", "data", namespace)
    assert pvc["status"]["phase"] == "Bound"
    assert pvc["spec"]["storageClassName"] == "kvtier-local"  # the default class, not named
    pv = cluster.get("pv", pvc["spec"]["volumeName"], namespace)
    host_dir = Path(pv["spec"]["hostPath"]["path"])
    assert cluster.dir / "pv" in host_dir.parents

    token = uuid.uuid4().hex
    probe(cluster, "writer", namespace, "write", "/data/token", token)
    cluster.kubectl("delete", "pod", "writer", "-n", namespace)
    cluster.apply([probe_pod("writer", volumes={"data": "/data"})], namespace)
    cluster.wait_ready("writer", namespace)
    assert probe(cluster, "writer", namespace, "read", "/data/token") == token
    assert (host_dir / "token").read_text() == token

    # Reclaim policy Delete: the claim gone, the volume and its data go too.
    cluster.kubectl("delete", "pod", "writer", "-n", namespace)
    cluster.kubectl("delete", "pvc", "data", "-n", namespace)
    cluster.eventually(
        "the PV deleted",
        lambda: cluster.kubectl("get", "pv", pv["metadata"]["name"], check=False).returncode != 0,
    )
    assert not host_dir.exists()


def test_service_account_token_reaches_the_api_server(cluster: Cluster, namespace: str) -> None:
    cluster.apply(
        [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}},
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "pod-reader"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "reader"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "pod-reader",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
            },
        ],
        namespace,
    )
    cluster.eventually(
        "the reader's token",
        lambda: cluster.get("serviceaccount", "reader", namespace).get("secrets"),
    )
    cluster.apply([probe_pod("reader", service_account="reader")], namespace)
    cluster.wait_ready("reader", namespace)

    # In-cluster config: the CA and token the kubelet mounted, the kubernetes Service's
    # ClusterIP (env) and its DNS name.
    env = cluster.exec("reader", namespace, "env").stdout
    assert "KUBERNETES_SERVICE_HOST=10.96.0.1" in env
    me = json.loads(
        probe(cluster, "reader", namespace, "kube", f"/api/v1/namespaces/{namespace}/pods/reader")
    )
    assert me["metadata"]["name"] == "reader"
    assert me["spec"]["serviceAccountName"] == "reader"
    # RBAC holds: nothing beyond the Role.
    denied = probe(
        cluster, "reader", namespace, "kube", "/api/v1/namespaces/kube-system/secrets", check=False
    )
    assert "403" in denied


def test_check_clean_sees_a_running_cluster(cluster: Cluster) -> None:
    """Negative control for the session's final check: while the cluster is up it is not clean."""
    result = subprocess.run(
        [str(CLUSTER), "check-clean", str(cluster.dir)], capture_output=True, text=True
    )
    assert result.returncode != 0
    for leftover in (
        "a cluster is up",
        "kvtier0",
        "KUBE-*/CNI-*",
        "of a cluster still runs",
        "admin.kubeconfig exists: the cluster's credentials must go with it",
    ):
        assert leftover in result.stderr, result.stderr
