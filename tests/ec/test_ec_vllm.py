"""The encoder cache across two vLLM processes (tiny Qwen2.5-VL): engine A encodes an
image and saves its output; engine B, another process, loads it and never runs its
vision encoder (a forward hook counts the encoder's calls), with A's output. A's
first run of an image is the no-cache run: its encoder ran and nothing was loaded.

Only the encoder-cache connector is on (no KV connector, no prefix cache): every
prompt token is computed, only the image's encoder output comes from the tier.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.testing.engine import EngineError, EngineProcess
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import prompt_text
from tests.ec.conftest import IMAGE, RELAXED, chat, image

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engines(
    vl_model: Path, module_tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> tuple[EngineProcess, EngineProcess]:
    config = {"target": module_tier.target, **RELAXED}
    a = start_engine(vl_model, name="a", ec_extra_config=config, multimodal=True, wait=False)
    b = start_engine(vl_model, name="b", ec_extra_config=config, multimodal=True, wait=False)
    a.wait_ready()
    b.wait_ready()
    return a, b


def encoded_by_a(a: EngineProcess, prompt: str, seed: int) -> list[int]:
    """A runs its encoder for the image (a miss) and saves the output to the tier."""
    calls, hits = a.encoder_calls(), a.ec_stats().get("hits", 0)
    (out,) = a.generate([{"prompt": prompt, "images": [image(seed)]}])
    assert a.encoder_calls() > calls
    assert a.ec_stats().get("hits", 0) == hits
    a.ec_flush()
    return out.token_ids


def test_an_image_encoded_by_one_engine_is_loaded_by_another_without_running_its_encoder(
    engines: tuple[EngineProcess, EngineProcess],
) -> None:
    a, b = engines
    prompt = chat(prompt_text(40, seed=1), IMAGE, prompt_text(30, seed=2))
    expected = encoded_by_a(a, prompt, seed=1)
    calls, before = b.encoder_calls(), b.ec_stats()

    (out,) = b.generate([{"prompt": prompt, "images": [image(1)]}])

    after = b.ec_stats()
    assert b.encoder_calls() == calls
    assert after.get("hits", 0) - before.get("hits", 0) == 1
    assert after.get("loaded_bytes", 0) > before.get("loaded_bytes", 0)
    assert out.token_ids == expected


def test_a_different_image_misses_and_runs_the_encoder(
    engines: tuple[EngineProcess, EngineProcess],
) -> None:
    a, b = engines
    prompt = chat(prompt_text(40, seed=3), IMAGE, prompt_text(30, seed=4))
    encoded_by_a(a, prompt, seed=3)
    calls, before = b.encoder_calls(), b.ec_stats()

    b.generate([{"prompt": prompt, "images": [image(4)]}])

    after = b.ec_stats()
    assert b.encoder_calls() > calls
    assert after.get("lookups", 0) - before.get("lookups", 0) == 1
    assert after.get("hits", 0) == before.get("hits", 0)


def test_an_image_still_in_vllms_own_encoder_cache_costs_the_tier_nothing(
    engines: tuple[EngineProcess, EngineProcess],
) -> None:
    """A repeat on the engine that encoded it: vLLM finds the output in its own encoder
    cache and never asks the connector, so no Get goes to the tier."""
    a, _ = engines
    prompt = chat(prompt_text(40, seed=7), IMAGE, prompt_text(30, seed=8))
    expected = encoded_by_a(a, prompt, seed=7)
    calls, before = a.encoder_calls(), a.ec_stats()

    (out,) = a.generate([{"prompt": prompt, "images": [image(7)]}])

    assert a.encoder_calls() == calls  # served by vLLM's encoder cache
    assert a.ec_stats().get("lookups", 0) == before.get("lookups", 0)
    assert out.token_ids == expected


def test_a_request_with_another_cache_salt_does_not_load_the_entry(
    engines: tuple[EngineProcess, EngineProcess],
) -> None:
    a, b = engines
    prompt = chat(prompt_text(50, seed=5), IMAGE, prompt_text(20, seed=6))
    expected = encoded_by_a(a, prompt, seed=5)
    calls, hits = b.encoder_calls(), b.ec_stats().get("hits", 0)

    (out,) = b.generate([{"prompt": prompt, "images": [image(5)], "cache_salt": "tenant-b"}])

    assert b.encoder_calls() > calls
    assert b.ec_stats().get("hits", 0) == hits
    assert out.token_ids == expected


def test_engine_naming_images_per_request_is_refused_with_the_flag_to_set(
    vl_model: Path, module_tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> None:
    # Both vLLM caches off: vLLM names an image after its request, not its content.
    config = {"target": module_tier.target, **RELAXED}

    with pytest.raises(EngineError) as refused:
        start_engine(
            vl_model, name="unhashed", ec_extra_config=config, multimodal=True,
            llm_kwargs={"enable_prefix_caching": False, "mm_processor_cache_gb": 0},
        )  # fmt: skip

    message = str(refused.value)
    assert "KvtierECConnector keys multimodal items by vLLM's item identifiers" in message
    assert "--mm-processor-cache-gb" in message
