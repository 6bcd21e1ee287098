"""A real Kubernetes control plane for tests, shared by tests/operator and tests/helm.

``ControlPlane`` is a directory that ``scripts/kube-env start`` filled: etcd and
kube-apiserver 1.20.2 on free 127.0.0.1 ports, ``admin.kubeconfig`` and
``operator.kubeconfig``. ``kube_env`` runs the script; its ``start`` builds and
caches the binaries first when they are missing (``scripts/kube-env build``), so
a fresh machine needs nothing else. ``client_for`` is a ``KubeClient`` with a
kubeconfig's credentials.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import kopf

from kvtier.operator.kube import KubeClient

ROOT = Path(__file__).resolve().parents[2]
KUBE_ENV = ROOT / "scripts" / "kube-env"


@dataclass(frozen=True)
class ControlPlane:
    dir: Path

    @property
    def admin_kubeconfig(self) -> Path:
        return self.dir / "admin.kubeconfig"

    @property
    def operator_kubeconfig(self) -> Path:
        return self.dir / "operator.kubeconfig"


def kube_env(*args: str | Path) -> None:
    """Run ``scripts/kube-env`` (``start DIR`` builds the binaries once if needed)."""
    subprocess.run([str(KUBE_ENV), *map(str, args)], check=True, stdout=subprocess.DEVNULL)


def client_for(kubeconfig: Path) -> KubeClient:
    """A client with a kubeconfig's credentials (what kopf would use)."""
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(kubeconfig)
    try:
        info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
    finally:
        if previous is None:
            del os.environ["KUBECONFIG"]
        else:
            os.environ["KUBECONFIG"] = previous
    assert info is not None
    return KubeClient.from_connection_info(info)
