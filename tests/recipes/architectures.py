"""The multimodal architectures of recipes/, as the tests see them.

One ``Architecture`` per recipe page: the exact vLLM architecture class, the tiny
random-weight builder of that class (tests/tinymodels), and how a prompt places one
multimodal item. ``VALIDATED`` is what the recipes index may mark ✓ for vLLM;
tests/recipes/test_pages.py checks the index, the pages and the YAMLs against it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.testing.tinymodels import (
    build_cohere2_vision_model,
    build_gemma3_model,
    build_idefics3_model,
    build_llava_model,
    build_mistral3_model,
    build_qwen2_5_omni_model,
    build_qwen2_audio_model,
    build_qwen2_vl_model,
    build_vl_model,
)


@dataclass(frozen=True)
class Architecture:
    page: str  # recipes/<page>.rst and recipes/<page>.yaml
    vllm_class: str
    build: Callable[[Path], Path]
    modality: str  # "image" or "audio"
    item_marker: str  # the prompt text that stands for one item
    item_tokens: int  # placeholder tokens one test item expands to
    turn: tuple[str, str]  # the text around the user's message
    sliding_window: bool = False  # the decoder interleaves sliding-window and full attention
    # (vLLM's hybrid KV cache manager gives it one KV cache group per kind of attention)
    config_class: str = ""  # config.json's architecture, where it is not vllm_class

    @property
    def hf_architecture(self) -> str:
        """What the model's config.json (and the recipe YAML) names."""
        return self.config_class or self.vllm_class

    def prompt(self, *parts: str) -> str:
        return self.turn[0] + "".join(parts) + self.turn[1]

    def item(self, seed: int) -> dict[str, Any]:
        """One test item (drawn from ``seed`` in the engine process)."""
        if self.modality == "audio":
            return {"seed": seed, "seconds": 2.0}
        return {"seed": seed, "size": [224, 224]}

    @property
    def mm_limits(self) -> dict[str, int]:
        return {self.modality: 1}


QWEN_TURN = ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")

ARCHITECTURES = [
    Architecture(
        page="qwen2_5_vl",
        vllm_class="Qwen2_5_VLForConditionalGeneration",
        build=build_vl_model,
        modality="image",
        item_marker="<|vision_start|><|image_pad|><|vision_end|>",
        item_tokens=64,
        turn=QWEN_TURN,
    ),
    Architecture(
        page="qwen2_vl",
        vllm_class="Qwen2VLForConditionalGeneration",
        build=build_qwen2_vl_model,
        modality="image",
        item_marker="<|vision_start|><|image_pad|><|vision_end|>",
        item_tokens=64,
        turn=QWEN_TURN,
    ),
    Architecture(
        page="llava",
        vllm_class="LlavaForConditionalGeneration",
        build=build_llava_model,
        modality="image",
        item_marker="<image>",
        item_tokens=64,
        turn=("USER: ", " ASSISTANT:"),
    ),
    Architecture(
        page="gemma3",
        vllm_class="Gemma3ForConditionalGeneration",
        build=build_gemma3_model,
        modality="image",
        item_marker="<start_of_image>",
        item_tokens=68,  # "\n\n<start_of_image>" + 64 soft tokens + "<end_of_image>\n\n"
        turn=("<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n"),
        sliding_window=True,
    ),
    Architecture(
        page="qwen2_audio",
        vllm_class="Qwen2AudioForConditionalGeneration",
        build=build_qwen2_audio_model,
        modality="audio",
        item_marker="<|audio_bos|><|AUDIO|><|audio_eos|>",
        item_tokens=52,  # 2 s at 16 kHz: 50 <|AUDIO|> tokens between bos and eos
        turn=QWEN_TURN,
    ),
    Architecture(
        page="mistral3",
        vllm_class="Mistral3ForConditionalGeneration",
        build=build_mistral3_model,
        modality="image",
        item_marker="[IMG]",
        item_tokens=20,  # 4 rows of 4 [IMG], each closed by [IMG_BREAK] / [IMG_END]
        turn=("<s>[INST]", "[/INST]"),
    ),
    Architecture(
        page="idefics3",
        vllm_class="Idefics3ForConditionalGeneration",
        build=build_idefics3_model,
        modality="image",
        item_marker="<image>",
        item_tokens=19,  # <fake_token_around_image><global-img>, 16 <image>, <fake_token...>
        turn=("<|im_start|>User:", "<end_of_utterance>\nAssistant:"),
    ),
    Architecture(
        page="qwen2_5_omni",
        vllm_class="Qwen2_5OmniThinkerForConditionalGeneration",
        config_class="Qwen2_5OmniModel",
        build=build_qwen2_5_omni_model,
        modality="image",
        item_marker="<|vision_bos|><|IMAGE|><|vision_eos|>",
        item_tokens=64,
        turn=QWEN_TURN,
    ),
    Architecture(
        page="cohere2_vision",
        vllm_class="Cohere2VisionForConditionalGeneration",
        build=build_cohere2_vision_model,
        modality="image",
        item_marker="<|IMG_PATCH|>",
        item_tokens=67,  # <|START_OF_IMG|>, 64 <|IMG_PATCH|>, <|IMG_LINE_BREAK|>, <|END_OF_IMG|>
        turn=(
            "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>",
            "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
        ),
        sliding_window=True,
    ),
]

BY_PAGE = {a.page: a for a in ARCHITECTURES}
