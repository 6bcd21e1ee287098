"""Fixtures for the end-to-end tests on real vLLM: tiny models, tiers, engine processes."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.engine import EngineProcess
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import build_text_model, build_vl_model

# Hit tests assert hits, not deadlines: generous ones, for a busy 2-core machine.
RELAXED = {"lookup_timeout_s": 10.0, "load_timeout_s": 20.0, "save_timeout_s": 20.0}

# Short deadlines and cool-down so the fault tests finish fast (defaults: docs/connector.md).
FAST_FAULTS = {
    "lookup_timeout_s": 2.5,
    "load_timeout_s": 3.0,
    "save_timeout_s": 2.0,
    "breaker_failures": 2,
    "breaker_cooldown_s": 0.5,
}


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory per session: models, and vLLM's cache shared by every engine."""
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def text_model(e2e_dir: Path) -> Path:
    return build_text_model(e2e_dir / "models" / "qwen2-tiny")


@pytest.fixture(scope="session")
def vl_model(e2e_dir: Path) -> Path:
    if importlib.util.find_spec("torchvision") is None:
        pytest.fail(
            "vLLM 0.32 cannot load Qwen2.5-VL without torchvision (transformers' Qwen2-VL "
            "processors import it): scripts/setup must install it guarded, see "
            "docs/connector.md 'vLLM on the CPU'"
        )
    return build_vl_model(e2e_dir / "models" / "qwen2_5_vl-tiny")


@pytest.fixture(scope="module")
def module_dir(e2e_dir: Path, request: pytest.FixtureRequest) -> Path:
    path = e2e_dir / request.module.__name__.rpartition(".")[2]
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module")
def module_tier(module_dir: Path) -> Iterator[TierProcess]:
    """A tier shared by the engines of one test module."""
    tier = TierProcess.start(module_dir / "tier")
    yield tier
    tier.stop()


@pytest.fixture(scope="module")
def start_engine(module_dir: Path) -> Iterator[Callable[..., EngineProcess]]:
    """Starts engine processes (``start_engine(model, name=..., extra_config=...)``),
    closed at the end of the module. With ``wait=False`` it returns at once: call
    ``engine.wait_ready()`` after starting the others."""
    engines: list[EngineProcess] = []

    def start(model: Path, *, name: str, **kwargs: Any) -> EngineProcess:
        engine = EngineProcess.start(model, module_dir / name, name=name, **kwargs)
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        engine.begin_close()
    for engine in engines:
        engine.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The fault tests' figures (tests/e2e/faultreport.py), as rows of docs/security.md's
    fault table: fault, transport, requests answered, wrong outputs, worst stall."""
    from tests.e2e.faultreport import ROWS

    if ROWS:
        terminalreporter.section("kvtier faults on real vLLM")
        for row in ROWS:
            terminalreporter.write_line(row.line())
