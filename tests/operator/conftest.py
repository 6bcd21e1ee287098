"""Fixtures of the operator's tests: a real control plane and the operator running against it.

``control_plane`` (session): etcd + kube-apiserver 1.20.2 + kube-controller-manager on
127.0.0.1, started by ``scripts/kube-env`` (which builds and caches the binaries
once), with the CRDs and the operator's ClusterRole (``operator/kvtier/operator/rbac.yaml``)
installed, bound to the user the operator runs as.

``operator`` (session): ``python -m kvtier.operator`` as that user, with a 1 s resync.

``kube`` and ``namespace`` (per test): an admin client and a fresh namespace.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kvtier.operator.kube import KubeClient, kind_of
from kvtier.testing.kube import ControlPlane, client_for, kube_env

ROOT = Path(__file__).resolve().parents[2]
CRD = kind_of("apiextensions.k8s.io/v1", "CustomResourceDefinition")
NAMESPACE = kind_of("v1", "Namespace")


@dataclass(frozen=True)
class OperatorProcess:
    process: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


async def _install(plane: ControlPlane) -> None:
    client = client_for(plane.admin_kubeconfig)
    try:
        for path in sorted((ROOT / "operator" / "kvtier" / "operator" / "crds").glob("*.yaml")):
            await client.apply(yaml.safe_load(path.read_text()))
        await client.apply(yaml.safe_load((ROOT / "operator" / "kvtier" / "operator" / "rbac.yaml").read_text()))
        await client.apply({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "kvtier-operator"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kvtier-operator"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "kvtier-operator"}],
        })  # fmt: skip
        for name in ("cachetiers.kvtier.io", "modelrecipes.kvtier.io"):
            for _ in range(100):
                crd = await client.get(CRD, None, name)
                conditions = ((crd or {}).get("status") or {}).get("conditions") or []
                if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"CRD {name} was not established")
    finally:
        await client.close()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(tmp_path_factory.mktemp("kube"))
    try:
        kube_env("start", plane.dir)
        asyncio.run(_install(plane))
        # After the CRDs: the garbage collector discovers new kinds only every 30 s.
        kube_env("start-controllers", plane.dir)
        yield plane
    finally:
        kube_env("stop", plane.dir)


@pytest.fixture(scope="session")
def operator(control_plane: ControlPlane) -> Iterator[OperatorProcess]:
    workdir = control_plane.dir / "operator"
    workdir.mkdir()
    log = workdir / "operator.log"
    with socket_port() as port:
        liveness = f"http://127.0.0.1:{port}/healthz"
    env = {**os.environ, "KUBECONFIG": str(control_plane.operator_kubeconfig)}
    with log.open("wb") as out:
        # From a directory without operator/: the checkout's root would shadow the stdlib module.
        process = subprocess.Popen(
            [sys.executable, "-m", "kvtier.operator", "--all-namespaces",
             "--resync-seconds", "1", "--traffic-seconds", "1", "--liveness", liveness,
             "--tier-image", "kvtier:test"],
            cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    running = OperatorProcess(process, log)
    try:
        _wait_for_liveness(liveness, running)
        yield running
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_for_liveness(url: str, running: OperatorProcess, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running.process.poll() is not None:
            raise AssertionError(f"the operator exited:\n{running.log_text()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the operator's liveness endpoint did not answer:\n{running.log_text()}")


class socket_port:
    """A free 127.0.0.1 TCP port (released on exit, for a server to bind next)."""

    def __enter__(self) -> int:
        import socket

        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        port: int = self._socket.getsockname()[1]
        return port

    def __exit__(self, *_: object) -> None:
        self._socket.close()


@pytest.fixture
async def kube(control_plane: ControlPlane) -> AsyncIterator[KubeClient]:
    client = client_for(control_plane.admin_kubeconfig)
    yield client
    await client.close()


@pytest.fixture
async def namespace(kube: KubeClient) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name
