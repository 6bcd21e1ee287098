"""Both caches on at once (KV connector and encoder-cache connector, one tier): engine B
loads the prompt's full chunks as KV and the image's encoder output, which the KV
cannot cover (the image ends in the partial last chunk), and gives A's output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.testing.engine import EngineProcess
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import prompt_text
from tests.ec.conftest import IMAGE, RELAXED, chat, image

pytestmark = pytest.mark.vllm

CHUNK = 256
IMAGE_TOKENS = 64  # a 224x224 image


@pytest.fixture(scope="module")
def engines(
    vl_model: Path, module_tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> tuple[EngineProcess, EngineProcess]:
    config = {"target": module_tier.target, "chunk_size": CHUNK, **RELAXED}
    kwargs = {"extra_config": config, "ec_extra_config": config, "multimodal": True}
    a = start_engine(vl_model, name="a", wait=False, **kwargs)
    b = start_engine(vl_model, name="b", wait=False, **kwargs)
    a.wait_ready()
    b.wait_ready()
    return a, b


def test_kv_chunks_and_the_encoder_output_both_load_and_the_output_is_the_same(
    engines: tuple[EngineProcess, EngineProcess],
) -> None:
    a, b = engines
    prompt = chat(prompt_text(260, seed=41), IMAGE, prompt_text(4, seed=42))
    tokens = len(a.tokenize(prompt)) + IMAGE_TOKENS - 1
    assert tokens // CHUNK >= 1 and tokens % CHUNK > 16, tokens  # the image ends in the tail
    (first,) = a.generate([{"prompt": prompt, "images": [image(7)]}])
    a.flush()
    a.ec_flush()
    calls, hits = b.encoder_calls(), b.ec_stats().get("hits", 0)

    (out,) = b.generate([{"prompt": prompt, "images": [image(7)]}])

    assert out.num_cached_tokens >= CHUNK  # KV from the tier
    assert b.ec_stats().get("hits", 0) == hits + 1  # the encoder output from the tier
    assert b.encoder_calls() == calls
    assert out.token_ids == first.token_ids
