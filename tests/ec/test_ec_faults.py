"""A frozen (SIGSTOP) or dead tier: engine F's encoder runs instead, the output is the same
as with a cache, and no call outlives its deadline by much.

Engine W writes the entries with generous deadlines; engine F has short ones
(``FAST_FAULTS``). The tier is frozen, then killed, in that order (one tier per module).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.testing.engine import EngineProcess
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import prompt_text
from tests.ec.conftest import FAST_FAULTS, IMAGE, RELAXED, chat, image

pytestmark = pytest.mark.vllm

# F's fetch deadline is FAST_FAULTS' 2.5 s; a request on this busy machine takes seconds.
NO_HANG_S = 60.0


@pytest.fixture(scope="module")
def engines(
    vl_model: Path, module_tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> tuple[EngineProcess, EngineProcess]:
    w_config = {"target": module_tier.target, **RELAXED}
    f_config = {"target": module_tier.target, **FAST_FAULTS}
    w = start_engine(vl_model, name="w", ec_extra_config=w_config, multimodal=True, wait=False)
    f = start_engine(vl_model, name="f", ec_extra_config=f_config, multimodal=True, wait=False)
    w.wait_ready()
    f.wait_ready()
    return w, f


def saved_by_w(w: EngineProcess, prompt: str, seed: int) -> list[int]:
    (out,) = w.generate([{"prompt": prompt, "images": [image(seed)]}])
    w.ec_flush()
    return out.token_ids


def run_on_f(f: EngineProcess, prompt: str, seed: int) -> tuple[list[int], int, float]:
    calls = f.encoder_calls()
    started = time.monotonic()
    (out,) = f.generate([{"prompt": prompt, "images": [image(seed)]}], max_tokens=16)
    return out.token_ids, f.encoder_calls() - calls, time.monotonic() - started


def test_a_frozen_tier_costs_a_deadline_and_the_encoder_runs(
    engines: tuple[EngineProcess, EngineProcess], module_tier: TierProcess
) -> None:
    w, f = engines
    prompt = chat(prompt_text(40, seed=31), IMAGE, prompt_text(20, seed=32))
    expected = saved_by_w(w, prompt, seed=31)
    errors = f.ec_stats().get("errors:load", 0)
    module_tier.freeze()
    try:
        tokens, encoder_runs, elapsed = run_on_f(f, prompt, seed=31)
    finally:
        module_tier.thaw()

    assert tokens == expected
    assert encoder_runs > 0
    assert f.ec_stats().get("errors:load", 0) > errors
    assert elapsed < NO_HANG_S


def test_a_dead_tier_and_the_encoder_runs(
    engines: tuple[EngineProcess, EngineProcess], module_tier: TierProcess
) -> None:
    """Two images W saved: the first costs F a failed call, the second may find the
    breaker open (refused at once); both are encoded."""
    w, f = engines
    prompts = {seed: chat(prompt_text(40, seed=seed), IMAGE, "ok") for seed in (33, 34)}
    expected = {seed: saved_by_w(w, prompt, seed) for seed, prompt in prompts.items()}
    module_tier.kill()

    for seed, prompt in prompts.items():
        tokens, encoder_runs, elapsed = run_on_f(f, prompt, seed)
        assert tokens == expected[seed]
        assert encoder_runs > 0
        assert elapsed < NO_HANG_S
    stats = f.ec_stats()
    assert stats.get("errors:load", 0) + stats.get("calls_skipped:load", 0) >= 2
    assert stats.get("breaker_open", 0) >= 1  # the gauge behind KvtierConnectorCircuitOpen
