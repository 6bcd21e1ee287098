"""Fixtures for the encoder-cache tests: the e2e ones (tiny models, tiers, engine processes)."""

from __future__ import annotations

from typing import Any

from tests.e2e.conftest import (  # noqa: F401  (fixtures, used by name)
    FAST_FAULTS,
    RELAXED,
    e2e_dir,
    module_dir,
    module_tier,
    start_engine,
    text_model,
    vl_model,
)

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def chat(*parts: str) -> str:
    return "<|im_start|>user\n" + "".join(parts) + "<|im_end|>\n<|im_start|>assistant\n"


def image(seed: int) -> dict[str, Any]:
    return {"seed": seed, "size": [224, 224]}
