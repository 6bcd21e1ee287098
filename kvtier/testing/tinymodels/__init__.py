"""Tiny random-weight models, built at test time (no hub access needed).

``build_text_model(root)`` makes a 2-layer ``Qwen2ForCausalLM``;
``build_vl_model(root)`` a tiny ``Qwen2_5_VLForConditionalGeneration`` (2-block
ViT) whose image placeholder span is 64 tokens for a 224x224 image. Both use a
byte-level BPE tokenizer trained locally. Builds are cached: a directory that
already holds a complete model is returned as is.

One builder per further recipe architecture, each the exact class vLLM serves:
``build_qwen2_vl_model`` (``Qwen2VLForConditionalGeneration``),
``build_llava_model`` (``LlavaForConditionalGeneration``, CLIP + Llama),
``build_gemma3_model`` (``Gemma3ForConditionalGeneration``, SigLIP + a sliding-window
and a full-attention layer) and ``build_qwen2_audio_model``
(``Qwen2AudioForConditionalGeneration``, 16 kHz audio), ``build_mistral3_model``
(``Mistral3ForConditionalGeneration``, Pixtral ViT + Mistral), ``build_idefics3_model``
(``Idefics3ForConditionalGeneration``, SmolVLM's class), ``build_qwen2_5_omni_model``
(Qwen2.5-Omni's thinker, ``Qwen2_5OmniThinkerForConditionalGeneration``),
``build_cohere2_vision_model`` (``Cohere2VisionForConditionalGeneration``, SigLIP + a Cohere2
decoder with three sliding-window layers per full-attention layer). All take
``(out, seed=0)`` and return ``out``; the Gemma 3 and Cohere2 Vision builders also take
the sliding window and the decoder's layer types.
"""

from .build import (
    build_gemma3_model,
    build_idefics3_model,
    build_llava_model,
    build_mistral3_model,
    build_qwen2_5_omni_model,
    build_qwen2_audio_model,
    build_qwen2_vl_model,
    build_text_model,
    build_vl_model,
    prompt_text,
)
from .cohere2_vision import build_cohere2_vision_model

__all__ = [
    "build_cohere2_vision_model",
    "build_gemma3_model",
    "build_idefics3_model",
    "build_llava_model",
    "build_mistral3_model",
    "build_qwen2_5_omni_model",
    "build_qwen2_audio_model",
    "build_qwen2_vl_model",
    "build_text_model",
    "build_vl_model",
    "prompt_text",
]
