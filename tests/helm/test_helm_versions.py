"""Both Helms the chart supports (README "Which Helm") install, upgrade and uninstall it
on a real kube-apiserver 1.20.2: Helm 4.3.1 (what scripts/helm-env gives users) and 3.17.3.

No kubelet runs here, so the upgrade is shown on the objects (the default CacheTier the
operator reconciles); the rolling tier under traffic is tests/cluster's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvtier.testing.kube import ControlPlane
from tests.helm.conftest import CHART, ROOT, Helm

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("major", ["3", "4"])
def test_install_upgrade_and_uninstall_work_with_helm(
    major: str, bare_control_plane: ControlPlane, tmp_path: Path
) -> None:
    bin_dir = subprocess.run(
        [str(ROOT / "scripts" / "helm-env"), major], check=True, capture_output=True, text=True
    ).stdout.strip()
    helm = Helm(Path(bin_dir) / "helm")
    assert helm.run("version", "--template", "{{.Version}}").stdout.startswith(f"v{major}.")
    namespace, kubeconfig = f"helm{major}", bare_control_plane.admin_kubeconfig

    def tier() -> dict[str, object]:
        out = subprocess.run(
            [str(Path(bin_dir) / "kubectl"), "--kubeconfig", str(kubeconfig), "--namespace", namespace,
             "get", "cachetier.kvtier.io", "kvtier", "--output", "json"],
            check=True, capture_output=True, text=True, timeout=60,
        ).stdout  # fmt: skip
        spec: dict[str, object] = json.loads(out)["spec"]
        return spec

    def status() -> dict[str, object]:
        out = helm.run("status", "kvtier", "--namespace", namespace, "--output", "json", kubeconfig=kubeconfig)
        info: dict[str, object] = json.loads(out.stdout)
        return info

    helm.run("install", "kvtier", CHART, "--namespace", namespace, "--create-namespace",
             kubeconfig=kubeconfig)  # fmt: skip
    assert tier()["ramBytes"] == "2Gi"
    helm.run("upgrade", "kvtier", CHART, "--namespace", namespace, "--set", "defaultTier.ramBytes=3Gi",
             "--reuse-values", kubeconfig=kubeconfig)  # fmt: skip
    assert tier()["ramBytes"] == "3Gi"
    assert status()["version"] == 2
    # --no-hooks: no kubelet here runs the pre-delete hook's pod (tests/cluster runs it on a node).
    helm.run("uninstall", "kvtier", "--namespace", namespace, "--wait", "--no-hooks", kubeconfig=kubeconfig)
    gone = helm.run("status", "kvtier", "--namespace", namespace, kubeconfig=kubeconfig, check=False)
    assert gone.returncode != 0 and "not found" in gone.stderr
