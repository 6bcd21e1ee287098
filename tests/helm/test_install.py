"""`helm install` / `helm uninstall` of the chart on a real kube-apiserver 1.20.2.

One release, installed once for the module, on a bare API server (no CRDs, no
RBAC): Helm itself must create and establish the CRDs before the default
CacheTier. No kubelet runs, so pods stay Pending; `helm test` needs one.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvtier.testing.kube import ControlPlane
from tests.helm.conftest import CHART, Helm

pytestmark = pytest.mark.slow

NAMESPACE = "kvtier-system"
CRDS = ("cachetiers.kvtier.io", "modelrecipes.kvtier.io")
# What the default values install (kind, namespaced, name).
RELEASE_OBJECTS = [
    ("serviceaccount", True, "kvtier-operator"),
    ("deployment.apps", True, "kvtier-operator"),
    ("clusterrole.rbac.authorization.k8s.io", False, "kvtier-operator"),
    ("clusterrolebinding.rbac.authorization.k8s.io", False, "kvtier-operator"),
    ("networkpolicy.networking.k8s.io", True, "kvtier-cache-tier"),
    ("networkpolicy.networking.k8s.io", True, "kvtier-operator"),
    ("configmap", True, "kvtier-dashboard-kvtier-overview"),
    ("cachetier.kvtier.io", True, "kvtier"),
]


@dataclass(frozen=True)
class Cluster:
    helm: Helm
    plane: ControlPlane

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.helm.binary.parent / "kubectl"), "--kubeconfig", str(self.plane.admin_kubeconfig), *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{result.stderr}")
        return result

    def get(self, kind: str, namespaced: bool, name: str) -> dict[str, Any] | None:
        where = ["--namespace", NAMESPACE] if namespaced else []
        result = self.kubectl("get", kind, name, *where, "--output", "json", check=False)
        if result.returncode != 0:
            assert "NotFound" in result.stderr, result.stderr
            return None
        found: dict[str, Any] = json.loads(result.stdout)
        return found


@pytest.fixture(scope="module")
def installed(helm: Helm, bare_control_plane: ControlPlane) -> Iterator[tuple[Cluster, str]]:
    """The chart installed with its defaults; yields the cluster and `helm install`'s output."""
    cluster = Cluster(helm, bare_control_plane)
    result = helm.run(
        "install", "kvtier", CHART, "--namespace", NAMESPACE, "--create-namespace",
        kubeconfig=bare_control_plane.admin_kubeconfig,
    )  # fmt: skip
    yield cluster, result.stdout
    helm.run("uninstall", "kvtier", "--namespace", NAMESPACE, "--ignore-not-found", "--no-hooks",
             kubeconfig=bare_control_plane.admin_kubeconfig)  # fmt: skip


def test_the_release_installs_and_is_deployed(helm: Helm, installed: tuple[Cluster, str]) -> None:
    cluster, _ = installed
    status = json.loads(helm.run(
        "status", "kvtier", "--namespace", NAMESPACE, "--output", "json",
        kubeconfig=cluster.plane.admin_kubeconfig,
    ).stdout)  # fmt: skip
    assert status["info"]["status"] == "deployed"


def test_the_crds_are_established(installed: tuple[Cluster, str]) -> None:
    cluster, _ = installed
    for name in CRDS:
        crd = cluster.get("customresourcedefinition", False, name)
        assert crd is not None, name
        conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conditions["Established"] == "True", name


def test_the_operators_objects_and_the_default_tier_exist(installed: tuple[Cluster, str]) -> None:
    cluster, _ = installed
    missing = [(kind, name) for kind, namespaced, name in RELEASE_OBJECTS
               if cluster.get(kind, namespaced, name) is None]  # fmt: skip
    assert not missing


def test_the_api_server_accepts_the_pods_restricted_security_fields(
    installed: tuple[Cluster, str],
) -> None:
    cluster, _ = installed
    deployment = cluster.get("deployment.apps", True, "kvtier-operator")
    assert deployment is not None
    spec = deployment["spec"]["template"]["spec"]
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_the_notes_name_the_next_commands(installed: tuple[Cluster, str]) -> None:
    _, output = installed
    assert 'the CacheTier "kvtier": 1 x (RAM 2Gi, disk 20Gi)' in output
    assert f"endpoint kvtier.{NAMESPACE}.svc:50051" in output
    assert f"kubectl -n {NAMESPACE} apply -f recipes/qwen2_5_vl.yaml" in output
    assert f"helm test kvtier -n {NAMESPACE}" in output


def test_uninstall_removes_the_release_objects_and_keeps_the_crds(
    helm: Helm, installed: tuple[Cluster, str]
) -> None:
    cluster, _ = installed
    # --no-hooks: no kubelet runs the pre-delete hook's pod on this control plane (it would
    # stay Pending); tests/cluster/test_user_story.py uninstalls with it on a real node.
    helm.run("uninstall", "kvtier", "--namespace", NAMESPACE, "--no-hooks",
             kubeconfig=cluster.plane.admin_kubeconfig)  # fmt: skip
    deadline = time.monotonic() + 30
    while left := [(kind, name) for kind, namespaced, name in RELEASE_OBJECTS
                   if cluster.get(kind, namespaced, name) is not None]:  # fmt: skip
        assert time.monotonic() < deadline, f"still there after helm uninstall: {left}"
        time.sleep(0.5)
    # Helm never deletes what it installed from crds/: users' ModelRecipes survive.
    assert all(cluster.get("customresourcedefinition", False, name) for name in CRDS)
