"""The encoder cache for audio (tiny Qwen2-Audio): engine A encodes a clip and saves its
output; engine B, another process, loads it without running its audio tower (a forward
hook counts the tower's calls), with A's output; another clip misses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.engine import EngineProcess
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import build_qwen2_audio_model, prompt_text
from tests.ec.conftest import RELAXED, chat

pytestmark = pytest.mark.vllm

AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"


@pytest.fixture(scope="module")
def audio_model(e2e_dir: Path) -> Path:
    return build_qwen2_audio_model(e2e_dir / "models" / "qwen2_audio-tiny")


@pytest.fixture(scope="module")
def engines(
    audio_model: Path, module_tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> tuple[EngineProcess, EngineProcess]:
    config = {"target": module_tier.target, **RELAXED}
    kwargs: dict[str, Any] = {
        "ec_extra_config": config,
        "multimodal": True,
        "limit_mm_per_prompt": {"audio": 1},
    }
    a = start_engine(audio_model, name="a", wait=False, **kwargs)
    b = start_engine(audio_model, name="b", wait=False, **kwargs)
    a.wait_ready()
    b.wait_ready()
    return a, b


def clip(seed: int) -> dict[str, Any]:
    return {"seed": seed, "seconds": 2.0}


def test_a_clip_encoded_by_one_engine_is_loaded_by_another_without_running_its_audio_tower(
    engines: tuple[EngineProcess, EngineProcess],
) -> None:
    a, b = engines
    prompt = chat(prompt_text(30, seed=51), AUDIO, prompt_text(10, seed=52))
    calls = a.encoder_calls()
    (first,) = a.generate([{"prompt": prompt, "audios": [clip(1)]}])
    assert a.encoder_calls() > calls
    a.ec_flush()
    calls, hits = b.encoder_calls(), b.ec_stats().get("hits", 0)

    (out,) = b.generate([{"prompt": prompt, "audios": [clip(1)]}])

    assert b.encoder_calls() == calls
    assert b.ec_stats().get("hits", 0) == hits + 1
    assert out.token_ids == first.token_ids


def test_another_clip_misses_and_runs_the_audio_tower(
    engines: tuple[EngineProcess, EngineProcess],
) -> None:
    _, b = engines
    prompt = chat(prompt_text(30, seed=53), AUDIO, "ok")
    calls, hits = b.encoder_calls(), b.ec_stats().get("hits", 0)

    b.generate([{"prompt": prompt, "audios": [clip(2)]}])

    assert b.encoder_calls() > calls
    assert b.ec_stats().get("hits", 0) == hits
