"""A tiny Cohere2VisionForConditionalGeneration (Command A Vision's class): SigLIP, a pixel
shuffle projector, and a Cohere2 decoder that interleaves sliding-window and full
attention (three sliding-window layers per full-attention layer, as Command A does)."""

from __future__ import annotations

from pathlib import Path

from .build import CLIP_MEAN, CLIP_STD, VOCAB_SIZE, _done, _save, _write_json, _write_tokenizer

COHERE2_VISION_TOKENS = [
    "<PAD>",
    "<BOS_TOKEN>",
    "<|END_OF_TURN_TOKEN|>",
    "<|START_OF_TURN_TOKEN|>",
    "<|USER_TOKEN|>",
    "<|CHATBOT_TOKEN|>",
    "<|START_OF_IMG|>",
    "<|END_OF_IMG|>",
    "<|IMG_PATCH|>",
    "<|IMG_LINE_BREAK|>",
]


def build_cohere2_vision_model(
    out: Path,
    seed: int = 0,
    *,
    sliding_window: int = 127,
    layer_types: tuple[str, ...] = ("sliding_attention",) * 3 + ("full_attention",),
) -> Path:
    """A tiny Cohere2VisionForConditionalGeneration: 2-layer SigLIP + a decoder of
    ``layer_types`` (default: three sliding-window layers, then one full-attention layer).

    vLLM gives Cohere2's sliding-window layers a window of ``sliding_window + 1`` tokens
    (its training convention): the default 127 makes vLLM's window 128. A 224x224 image
    is one tile of 16x16 patches, pixel-shuffled 2x2 into 64 ``<|IMG_PATCH|>`` tokens,
    then ``<|IMG_LINE_BREAK|>``, between ``<|START_OF_IMG|>`` and ``<|END_OF_IMG|>``:
    67 placeholder tokens.
    """
    if _done(out):
        return out
    import torch
    from transformers import Cohere2VisionConfig, Cohere2VisionForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(
        out,
        COHERE2_VISION_TOKENS,
        eos="<|END_OF_TURN_TOKEN|>",
        pad="<PAD>",
        chat_template=None,
        boi_token="<|START_OF_IMG|>",
        eoi_token="<|END_OF_IMG|>",
        image_token="<|IMG_PATCH|>",
        img_line_break_token="<|IMG_LINE_BREAK|>",
    )
    torch.manual_seed(seed)
    config = Cohere2VisionConfig(
        text_config={
            "model_type": "cohere2",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": len(layer_types),
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "sliding_window": sliding_window,
            "layer_types": list(layer_types),
            "max_position_embeddings": 8192,
            "initializer_range": 0.25,
            "logit_scale": 1.0,
            "bos_token_id": ids["<BOS_TOKEN>"],
            "eos_token_id": ids["<|END_OF_TURN_TOKEN|>"],
            "pad_token_id": ids["<PAD>"],
        },
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 224,
            "patch_size": 14,
        },
        downsample_factor=2,
        image_token_id=ids["<|IMG_PATCH|>"],
        alignment_intermediate_size=128,
        tie_word_embeddings=True,
    )
    config.dtype = torch.bfloat16
    model = Cohere2VisionForConditionalGeneration(config).to(torch.bfloat16)
    _save(model, out, (("model.vision_tower.", "model.vision_tower.vision_model."),))
    _write_json(
        out,
        "preprocessor_config.json",
        {
            "image_processor_type": "Cohere2VisionImageProcessor",
            "processor_class": "Cohere2VisionProcessor",
            "do_resize": True,
            "size": {"height": 224, "width": 224},
            "crop_to_patches": False,
            "patch_size": 8,  # sqrt of the tokens per tile, as the processor reads it
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "do_convert_rgb": True,
        },
    )
    _write_json(out, "processor_config.json", {"processor_class": "Cohere2VisionProcessor"})
    (out / ".complete").touch()
    return out
