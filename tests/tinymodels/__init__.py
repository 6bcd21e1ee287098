"""Tiny random-weight models, built at test time (no hub access needed).

``build_text_model(root)`` makes a 2-layer ``Qwen2ForCausalLM``;
``build_vl_model(root)`` a tiny ``Qwen2_5_VLForConditionalGeneration`` (2-block
ViT) whose image placeholder span is 64 tokens for a 224x224 image. Both use a
byte-level BPE tokenizer trained locally. Builds are cached: a directory that
already holds a complete model is returned as is.
"""

from .build import build_text_model, build_vl_model, prompt_text

__all__ = ["build_text_model", "build_vl_model", "prompt_text"]
