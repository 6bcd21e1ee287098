"""A real one-node Kubernetes cluster for the tests that need pods that really run.

``cluster`` (session): ``scripts/cluster up`` in a tmp dir (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kubelet, kube-proxy, containerd + runc, CNI bridge,
cluster DNS, a default StorageClass; see docs/cluster.md), with the images the tests name
imported by ``scripts/images load``. At the end it is ALWAYS torn down (``scripts/cluster
down``), even when a test or the start-up failed, and ``scripts/cluster check-clean`` must
then pass: a leftover process, interface, mount, iptables rule, sysctl or path is an error
of the session's last test.

The slow, cached preparation (building Kubernetes from source, the base root filesystem and
the images) runs once after collection, before the first test, so it does not count against
a test's timeout: on a fresh machine it takes ~15 min, then seconds.

Needs root (one node per machine); tests are skipped when the process is not root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "scripts" / "cluster"
STATE = Path("/run/kvtier-cluster/dir")  # which DIR is up (scripts/cluster)
BRIDGE = Path("/sys/class/net/kvtier0")  # holds 10.244.0.1 while the cluster is up
IMAGES = ROOT / "scripts" / "images"
# The images every cluster test session loads (rows of scripts/images' table). A test module
# that needs more names them in CLUSTER_IMAGES: they are built with these, before the first
# test (the module imports them into the node itself).
TEST_IMAGES = ("kvtier-probe",)


def _run(*cmd: str | Path, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)


_PREPARED: list[str] = []  # what the preparation reported when it failed


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build (or find cached) what the cluster needs, outside every test's timeout."""
    items = [item for item in session.items if item.get_closest_marker("cluster")]
    if os.geteuid() != 0 or not items:
        return
    images = list(TEST_IMAGES)
    for item in items:
        for name in getattr(item.module, "CLUSTER_IMAGES", ()):
            if name not in images:
                images.append(name)
    for step in ([ROOT / "scripts" / "kube-env", "build"], [IMAGES, "build", *images]):
        result = _run(*step)
        if result.returncode != 0:
            _PREPARED.append(f"{' '.join(map(str, step))} failed:\n{result.stderr[-4000:]}")
            return


@dataclass(frozen=True)
class Cluster:
    dir: Path
    kubectl_bin: Path

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "admin.kubeconfig"

    def require_up(self) -> None:
        """Refuse to talk to a cluster that is not up: its addresses would not be on this
        machine any more, and a request would leave through the default route."""
        up = STATE.read_text().strip() if STATE.exists() else None
        if up != str(self.dir) or not BRIDGE.exists() or not self.kubeconfig.exists():
            raise AssertionError(
                f"the cluster in {self.dir} is not up: no kubectl or helm against it"
            )

    @staticmethod
    def image(name: str) -> str:
        """The reference pods use for an image of scripts/images' table."""
        return _run(IMAGES, "ref", name).stdout.strip()

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        self.require_up()
        cmd = [
            str(self.kubectl_bin),
            "--kubeconfig",
            str(self.kubeconfig),
            "--cache-dir",
            str(self.dir / "kubectl-cache"),
            *args,
        ]
        result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}"
            )
        return result

    def apply(self, objects: Sequence[dict[str, Any]], namespace: str) -> None:
        self.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(objects))

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any]:
        out = self.kubectl("get", kind, name, "-n", namespace, "-o", "json").stdout
        return json.loads(out)  # type: ignore[no-any-return]

    def wait_ready(self, pod: str, namespace: str, timeout: int = 120) -> None:
        result = self.kubectl(
            "wait",
            "--for=condition=Ready",
            f"pod/{pod}",
            "-n",
            namespace,
            f"--timeout={timeout}s",
            check=False,
            timeout=timeout + 30,
        )
        if result.returncode != 0:
            describe = self.kubectl("describe", "pod", pod, "-n", namespace, check=False).stdout
            raise AssertionError(f"pod {namespace}/{pod} not Ready:\n{result.stderr}\n{describe}")

    def helm(
        self, *args: str, check: bool = True, timeout: float = 900
    ) -> subprocess.CompletedProcess[str]:
        """``helm ARGS`` against this cluster (the admin kubeconfig)."""
        self.require_up()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        cmd = [str(self.kubectl_bin.with_name("helm")), *args]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if check and result.returncode != 0:
            raise AssertionError(
                f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}"
            )
        return result

    def exec(
        self, pod: str, namespace: str, *cmd: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.kubectl("exec", pod, "-n", namespace, "--", *cmd, check=check)

    def eventually(self, what: str, probe: Any, timeout: float = 60) -> Any:
        """Poll ``probe()`` until it returns something truthy."""
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.5)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """The cluster; KVTIER_TEST_CLUSTER=DIR uses the one already up in DIR (started by
    ``scripts/cluster up DIR``) and leaves it up: for working on one test module at a time."""
    if os.geteuid() != 0:
        pytest.skip("the one-node cluster needs root (network namespaces, iptables, mounts)")
    if _PREPARED:
        raise AssertionError(_PREPARED[0])
    kubectl_dir = _run(ROOT / "scripts" / "helm-env").stdout.strip()
    if os.environ.get("KVTIER_TEST_CLUSTER"):
        given = Cluster(
            Path(os.environ["KVTIER_TEST_CLUSTER"]).resolve(), Path(kubectl_dir) / "kubectl"
        )
        given.require_up()
        load = _run(IMAGES, "load", given.dir, *TEST_IMAGES)
        assert load.returncode == 0, load.stderr[-4000:]
        yield given
        return
    # Not under pytest's basetemp: another pytest session on the machine deletes all but the
    # last three basetemps when it starts, which removed a cluster's DIR while it was up.
    directory = Path(tempfile.mkdtemp(prefix="kvtier-kc-", dir="/tmp"))
    try:
        up = _run(CLUSTER, "up", directory, timeout=900)
        print(up.stderr, file=sys.stderr)
        if up.returncode != 0:
            raise AssertionError(f"scripts/cluster up failed:\n{up.stderr[-6000:]}")
        load = _run(IMAGES, "load", directory, *TEST_IMAGES)
        if load.returncode != 0:
            raise AssertionError(f"scripts/images load failed:\n{load.stderr[-4000:]}")
        yield Cluster(directory, Path(kubectl_dir) / "kubectl")
    finally:
        down = _run(CLUSTER, "down", directory, timeout=300)
        clean = _run(CLUSTER, "check-clean", directory, timeout=120)
        print(down.stderr + clean.stderr, file=sys.stderr)  # shown with -s or on failure
        if down.returncode != 0 or clean.returncode != 0:
            raise AssertionError(
                "the cluster did not tear down cleanly:\n" + down.stderr[-3000:] + clean.stderr
            )
        # Nothing can use the cluster's credentials after down (its addresses are gone).
        left = [
            p for p in (directory / "admin.kubeconfig", directory / "kubeconfigs") if p.exists()
        ]
        left += list((directory / "pki").glob("*.key"))
        assert not left, f"credentials of a cluster that is down remain: {left}"
        shutil.rmtree(directory)  # clean: its logs, state and volumes are not needed any more


@pytest.fixture(scope="module")
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of the module's own, deleted after it."""
    name = request.module.__name__.rsplit(".", 1)[-1].replace("_", "-").lower()
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
