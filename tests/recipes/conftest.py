"""Fixtures for the recipes tests: one tier, and two engine processes per architecture."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.testing.engine import EngineProcess
from kvtier.testing.tierproc import TierProcess
from tests.e2e.conftest import RELAXED
from tests.recipes.architectures import ARCHITECTURES, Architecture

CHUNK = 256
INSPECTION_WAIT_S = 120.0


@pytest.fixture(scope="session")
def recipes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("recipes")


@pytest.fixture(scope="module")
def recipes_tier(recipes_dir: Path) -> Iterator[TierProcess]:
    """One tier for every architecture (keys pin the model, so they never meet)."""
    tier = TierProcess.start(recipes_dir / "tier")
    yield tier
    tier.stop()


def wait_for_model_inspection(cache: Path, arch: Architecture, first: EngineProcess) -> None:
    """Until the first engine has cached vLLM's one-time inspection of the model class
    (VLLM_CACHE_ROOT/modelinfos, shared by the engines): the second engine then skips
    that subprocess (tens of CPU-seconds on a busy 2-core machine). Only a speed-up: after
    the deadline, or if the first engine died, the second starts anyway."""
    deadline = time.monotonic() + INSPECTION_WAIT_S
    while time.monotonic() < deadline and first.proc.poll() is None:
        if any(cache.glob(f"modelinfos/*-{arch.vllm_class}.json")):
            return
        time.sleep(0.2)


class Engines:
    """Two engine processes with the kvtier KV connector and the encoder-cache connector
    on one tier. A stores its KV chunks zstd-compressed, B raw (the codec is in each
    chunk's header: each engine reads the other's chunks)."""

    def __init__(self, arch: Architecture, a: EngineProcess, b: EngineProcess) -> None:
        self.arch, self.a, self.b = arch, a, b


@contextlib.contextmanager
def two_engines(
    arch: Architecture,
    recipes_dir: Path,
    tier: TierProcess,
    tag: str = "",
    env: dict[str, str] | None = None,
) -> Iterator[Engines]:
    """Engines A (zstd chunks) and B (raw) of ``arch`` on ``tier``, stopped at the end
    (``tag`` keeps their directories apart from other engines of ``arch``; ``env``: more
    environment variables of both)."""
    model = arch.build(recipes_dir / "models" / arch.page)
    config = {"target": tier.target, "chunk_size": CHUNK, **RELAXED}
    codecs = {"a": "zstd", "b": "raw"}
    work = recipes_dir / "engines"
    started: list[EngineProcess] = []
    try:
        for name in ("a", "b"):
            if started:
                wait_for_model_inspection(work / "vllm-cache", arch, started[0])
            started.append(
                EngineProcess.start(
                    model,
                    work / f"{arch.page}{tag}-{name}",
                    name=name,
                    extra_config={**config, "codec": codecs[name]},
                    ec_extra_config=config,
                    multimodal=True,
                    limit_mm_per_prompt=arch.mm_limits,
                    env=env,
                    wait=False,
                )
            )
        for engine in started:
            engine.wait_ready()
        yield Engines(arch, *started)
    finally:
        for engine in started:
            engine.begin_close()
        for engine in started:
            engine.close()


@pytest.fixture(scope="module", params=ARCHITECTURES, ids=lambda a: a.page)
def engines(
    request: pytest.FixtureRequest, recipes_dir: Path, recipes_tier: TierProcess
) -> Iterator[Engines]:
    """Two engines of one architecture, alive while its tests run (then the next one's)."""
    with two_engines(request.param, recipes_dir, recipes_tier) as engines:
        yield engines
