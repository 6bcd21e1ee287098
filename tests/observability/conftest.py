"""Fixtures of the observability tests: the tools (scripts/obs-env) and real scrapes."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.testing.queries import ROOT
from kvtier.testing.tierproc import TierProcess


@dataclass(frozen=True)
class ObsTools:
    prometheus: str
    promtool: str
    grafana_schema_dir: Path


@pytest.fixture(scope="session")
def obs_tools() -> ObsTools:
    """prometheus, promtool and @grafana/schema + typescript, installed once (cached)."""
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "obs-env")], capture_output=True, text=True, timeout=900
    )
    if result.returncode != 0:
        pytest.fail(f"scripts/obs-env failed:\n{result.stderr}")
    found = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return ObsTools(found["PROMETHEUS"], found["PROMTOOL"], Path(found["GRAFANA_SCHEMA_DIR"]))


@pytest.fixture
def promtool(obs_tools: ObsTools) -> str:
    return obs_tools.promtool


@pytest.fixture(scope="module")
def module_tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TierProcess]:
    # With the same-node socket: its series are in the scrape too (and must be documented).
    tier = TierProcess.start(tmp_path_factory.mktemp("tier"), local_socket=True)
    yield tier
    tier.stop()
