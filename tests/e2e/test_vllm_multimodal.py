"""Images across two vLLM processes (tiny Qwen2.5-VL): the image decides the keys.

Every image placeholder span is 64 tokens of one token id, so only the multimodal
substitution in the keys tells two images apart. Engine A saves; engine B, another
process, loads. A unique ``cache_salt`` gives the no-cache reference.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.engine import EngineError, EngineProcess
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import prompt_text
from tests.e2e.conftest import RELAXED

pytestmark = pytest.mark.vllm

CHUNK = 256
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_TOKENS = 64  # a 224x224 image


@pytest.fixture(scope="module")
def engines(
    vl_model: Path, module_tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> tuple[EngineProcess, EngineProcess]:
    config = {"target": module_tier.target, "chunk_size": CHUNK, **RELAXED}
    a = start_engine(vl_model, name="a", extra_config=config, multimodal=True, wait=False)
    b = start_engine(vl_model, name="b", extra_config=config, multimodal=True, wait=False)
    a.wait_ready()
    b.wait_ready()
    return a, b


def chat(*parts: str) -> str:
    return "<|im_start|>user\n" + "".join(parts) + "<|im_end|>\n<|im_start|>assistant\n"


def image(seed: int) -> dict[str, Any]:
    return {"seed": seed, "size": [224, 224]}


def offsets(engine: EngineProcess, prompt: str) -> list[int]:
    """Token offsets of the image spans of ``prompt`` once vLLM expands them."""
    pieces = prompt.split(IMAGE)
    found, text = [], ""
    for i, piece in enumerate(pieces[:-1]):
        text += piece + "<|vision_start|>"
        found.append(len(engine.tokenize(text)) + i * (IMAGE_TOKENS - 1))
        text += "<|image_pad|><|vision_end|>"
    return found


def reference(engine: EngineProcess, prompt: str, images: list[dict[str, Any]]) -> list[int]:
    (out,) = engine.generate([{"prompt": prompt, "images": images, "cache_salt": "reference"}])
    assert out.num_cached_tokens == 0
    return out.token_ids


def saved_by_a(engines, prompt: str, images: list[dict[str, Any]]) -> list[int]:
    a, _ = engines
    (out,) = a.generate([{"prompt": prompt, "images": images}])
    assert out.num_cached_tokens == 0
    a.flush()
    return out.token_ids


def test_same_text_and_image_hit_in_another_process(engines) -> None:
    _, b = engines
    prompt = chat(prompt_text(100, seed=20), IMAGE, prompt_text(300, seed=21))
    expected = saved_by_a(engines, prompt, [image(1)])

    (out,) = b.generate([{"prompt": prompt, "images": [image(1)]}])

    assert out.num_prompt_tokens > 3 * CHUNK
    assert out.num_cached_tokens == out.num_prompt_tokens // CHUNK * CHUNK
    assert out.token_ids == expected


def test_other_image_hits_only_the_chunks_before_it(engines) -> None:
    _, b = engines
    prompt = chat(prompt_text(150, seed=22), IMAGE, prompt_text(200, seed=23))
    saved_by_a(engines, prompt, [image(1)])
    (offset,) = offsets(b, prompt)
    assert CHUNK < offset < 2 * CHUNK - IMAGE_TOKENS  # the image sits inside chunk 1

    (out,) = b.generate([{"prompt": prompt, "images": [image(2)]}])

    assert out.num_cached_tokens == CHUNK  # chunk 0 only: chunk 1 holds the other image
    assert out.token_ids == reference(b, prompt, [image(2)])


def test_two_images_in_one_prompt(engines) -> None:
    _, b = engines
    prompt = chat(
        prompt_text(40, seed=24), IMAGE, prompt_text(220, seed=25), IMAGE, prompt_text(120, seed=26)
    )
    expected = saved_by_a(engines, prompt, [image(3), image(4)])
    first, second = offsets(b, prompt)
    assert first < CHUNK and 2 * CHUNK < second < 3 * CHUNK - IMAGE_TOKENS

    (same,) = b.generate([{"prompt": prompt, "images": [image(3), image(4)]}])
    (other_second,) = b.generate([{"prompt": prompt, "images": [image(3), image(5)]}])

    assert same.num_cached_tokens == same.num_prompt_tokens // CHUNK * CHUNK
    assert same.token_ids == expected
    assert other_second.num_cached_tokens == 2 * CHUNK  # up to the chunk of the second image
    assert other_second.token_ids == reference(b, prompt, [image(3), image(5)])


# vLLM names an image after its request (not its content) when both its prefix cache and
# its multimodal processor cache are off: the connector refuses that engine at start.
PER_REQUEST_NAMES = {"enable_prefix_caching": False, "mm_processor_cache_gb": 0}


def test_engine_naming_images_per_request_is_refused_with_the_flag_to_set(
    vl_model: Path, module_tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> None:
    config = {"target": module_tier.target, "chunk_size": CHUNK, **RELAXED}

    with pytest.raises(EngineError) as refused:
        start_engine(
            vl_model, name="unhashed", extra_config=config, multimodal=True,
            llm_kwargs=PER_REQUEST_NAMES,
        )  # fmt: skip

    message = str(refused.value)
    assert "KvtierConnector keys multimodal items by vLLM's item identifiers" in message
    assert "--mm-processor-cache-gb" in message
    assert "--enable-prefix-caching" in message


def test_engine_with_prefix_cache_and_no_processor_cache_hits_images_saved_by_another(
    engines, vl_model: Path, module_tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> None:
    # Content-hashed names need only one of the two caches: the prefix cache here.
    prompt = chat(prompt_text(90, seed=27), IMAGE, prompt_text(300, seed=28))
    expected = saved_by_a(engines, prompt, [image(6)])
    config = {"target": module_tier.target, "chunk_size": CHUNK, **RELAXED}
    c = start_engine(
        vl_model, name="c", extra_config=config, multimodal=True,
        llm_kwargs={"enable_prefix_caching": True, "mm_processor_cache_gb": 0},
    )  # fmt: skip

    (out,) = c.generate([{"prompt": prompt, "images": [image(6)]}])

    assert out.num_cached_tokens == out.num_prompt_tokens // CHUNK * CHUNK > 0
    assert out.token_ids == expected
