"""Builders for the tiny random-weight models (see the package docstring)."""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB_SIZE = 2048
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# A Qwen2-VL-style chat template: text parts and image parts of OpenAI chat messages.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "cache tier chunk key block token image model vision prefix layer engine "
    "request tenant store load save hash disk memory redis cluster node pod "
    "the a of and to in is for on with that by this from at as be are was it"
).split()


def prompt_text(n_words: int, seed: int = 0) -> str:
    """Deterministic pseudo-English text (two to three tokens per word for this tokenizer)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) + str(rng.randrange(100)) for _ in range(n_words))


def _corpus() -> list[str]:
    rng = random.Random(1234)
    lines = []
    for _ in range(3000):
        lines.append(" ".join(rng.choice(_WORDS) + str(rng.randrange(100)) for _ in range(20)))
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def _write_tokenizer(
    out: Path,
    special: list[str] | None = None,
    plain: tuple[str, ...] = (),
    eos: str = "<|im_end|>",
    pad: str = "<|endoftext|>",
    chat_template: str | None = CHAT_TEMPLATE,
    **named: str,
) -> dict[str, int]:
    """A byte-level BPE tokenizer of ``VOCAB_SIZE`` entries with ``special`` tokens last.

    ``plain`` are added as ordinary (non-special) vocabulary entries, matched verbatim
    (Gemma 3's processor looks up "\\n\\n" as one token); ``named`` sets tokenizer
    attributes such as ``image_token``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = SPECIAL_TOKENS if special is None else special
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(special) - len(plain),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    if plain:
        tok.add_tokens([AddedToken(t, normalized=False) for t in plain])
    tok.add_special_tokens(special)
    extra = {"extra_special_tokens": named} if named else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=pad, model_max_length=8192, **extra
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(out))
    return {t: tok.token_to_id(t) for t in [*special, *plain]}


def _text_config_kwargs(ids: dict[str, int]) -> dict[str, object]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 8192,
        # With the usual 0.02, greedy decoding of a random model repeats one token.
        "initializer_range": 0.25,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
    }


def _done(out: Path) -> bool:
    return (out / ".complete").exists()


def build_text_model(out: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen2ForCausalLM (hidden 128, 2 heads, 1 KV head) in ``out``."""
    if _done(out):
        return out
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(out)
    torch.manual_seed(seed)
    config = Qwen2Config(
        **_text_config_kwargs(ids), rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
    )
    config.dtype = torch.bfloat16
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out))
    (out / ".complete").touch()
    return out


# Qwen2.5-VL's vision transformer, tiny (Qwen2.5-Omni's thinker has the same one).
QWEN2_5_VIT: dict[str, object] = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "out_hidden_size": 128,
    "fullatt_block_indexes": [1],
    "window_size": 112,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "initializer_range": 0.25,
}
# Multimodal RoPE (Qwen2-VL and later) for head size 64: sections of the 32 rotary pairs.
MROPE_PARAMETERS: dict[str, object] = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "mrope_section": [8, 12, 12],
}
# Qwen2-VL's image processor (14 px patches, 2x2 merge), also Qwen2.5-VL's and Qwen2.5-Omni's.
QWEN_IMAGE_PROCESSOR: dict[str, object] = {
    # transformers' PIL backend: needs no torchvision (uninstalled here, see docs/connector.md).
    "image_processor_type": "Qwen2VLImageProcessorPil",
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136,
    "max_pixels": 1003520,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
# A Whisper feature extractor for 16 kHz audio (Qwen2-Audio's and Qwen2.5-Omni's).
WHISPER_FEATURES: dict[str, object] = {
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "chunk_length": 30,
    "n_fft": 400,
    "n_samples": 480000,
    "nb_max_frames": 3000,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
}


def build_vl_model(out: Path, seed: int = 0) -> Path:
    """A tiny Qwen2_5_VLForConditionalGeneration (ViT depth 2) in ``out``.

    A 224x224 image becomes 16x16 patches of 14 px, merged 2x2: 64 placeholder tokens.
    """
    if _done(out):
        return out
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(out)
    torch.manual_seed(seed)
    text = _text_config_kwargs(ids)
    text["rope_parameters"] = dict(MROPE_PARAMETERS)
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(QWEN2_5_VIT),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.dtype = torch.bfloat16
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(str(out))
    preprocessor = {**QWEN_IMAGE_PROCESSOR, "processor_class": "Qwen2_5_VLProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (out / ".complete").touch()
    return out


# -- more architectures (recipes/): each the exact class vLLM serves ------------------------


def _save(model: object, out: Path, renames: tuple[tuple[str, str], ...] = ()) -> None:
    """``save_pretrained``, then rename weight-key prefixes transformers 5 writes
    differently from what vLLM 0.32 loads (``(old_prefix, new_prefix)`` pairs)."""
    model.save_pretrained(str(out))  # type: ignore[attr-defined]
    if not renames:
        return
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    weights = load_file(str(path))
    renamed = {}
    for key, value in weights.items():
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        renamed[key] = value
    save_file(renamed, str(path), metadata={"format": "pt"})


def _write_json(out: Path, name: str, data: dict[str, object]) -> None:
    (out / name).write_text(json.dumps(data, indent=2))


CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def build_qwen2_vl_model(out: Path, seed: int = 0) -> Path:
    """A tiny Qwen2VLForConditionalGeneration (ViT depth 2): 64 placeholder tokens per
    224x224 image, the same tokenizer and prompt format as ``build_vl_model``."""
    if _done(out):
        return out
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(out)
    torch.manual_seed(seed)
    text = _text_config_kwargs(ids)
    text["rope_parameters"] = dict(MROPE_PARAMETERS)
    config = Qwen2VLConfig(
        text_config=text,
        vision_config={
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": 128,
            "mlp_ratio": 2,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "initializer_range": 0.25,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.dtype = torch.bfloat16
    _save(Qwen2VLForConditionalGeneration(config).to(torch.bfloat16), out)
    _write_json(
        out,
        "preprocessor_config.json",
        {
            "image_processor_type": "Qwen2VLImageProcessorPil",
            "processor_class": "Qwen2VLProcessor",
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "rescale_factor": 1 / 255,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "min_pixels": 3136,
            "max_pixels": 1003520,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
        },
    )
    (out / ".complete").touch()
    return out


def _llama_text_config(ids: dict[str, int], eos: str, pad: str) -> dict[str, object]:
    text = _text_config_kwargs({**ids, "<|endoftext|>": ids[pad], "<|im_end|>": ids[eos]})
    text.update(
        model_type="llama",
        bos_token_id=ids[pad],
        eos_token_id=ids[eos],
        pad_token_id=ids[pad],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return text


LLAVA_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]


def build_llava_model(out: Path, seed: int = 0) -> Path:
    """A tiny LlavaForConditionalGeneration (2-layer CLIP ViT + 2-layer Llama).

    A 112x112 image is 8x8 patches of 14 px: 64 ``<image>`` placeholder tokens.
    """
    if _done(out):
        return out
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(out, LLAVA_TOKENS, chat_template=None)
    torch.manual_seed(seed)
    config = LlavaConfig(
        text_config=_llama_text_config(ids, "<|im_end|>", "<|endoftext|>"),
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 112,
            "patch_size": 14,
            "projection_dim": 64,
            "initializer_range": 0.25,
        },
        image_token_index=ids["<image>"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    config.dtype = torch.bfloat16
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
    _save(model, out, (("vision_tower.", "vision_tower.vision_model."),))
    _write_json(
        out,
        "preprocessor_config.json",
        {
            "image_processor_type": "CLIPImageProcessorPil",
            "processor_class": "LlavaProcessor",
            "do_resize": True,
            "size": {"shortest_edge": 112},
            "do_center_crop": True,
            "crop_size": {"height": 112, "width": 112},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "do_convert_rgb": True,
        },
    )
    _write_json(
        out,
        "processor_config.json",
        {
            "processor_class": "LlavaProcessor",
            "patch_size": 14,
            "vision_feature_select_strategy": "default",
            "image_token": "<image>",
            "num_additional_image_tokens": 1,
        },
    )
    (out / ".complete").touch()
    return out


GEMMA3_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]


def build_gemma3_model(
    out: Path,
    seed: int = 0,
    *,
    sliding_window: int = 128,
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention"),
    max_position_embeddings: int = 8192,
) -> Path:
    """A tiny Gemma3ForConditionalGeneration: 2-layer SigLIP + a decoder whose layers are
    ``layer_types`` (default: one sliding-window layer, window ``sliding_window`` = 128,
    then one full-attention layer; Gemma 3's own pattern is five sliding-window layers
    per full-attention layer).

    A 224x224 image is 16x16 patches pooled to 64 ``<image_soft_token>`` placeholders.
    """
    if _done(out):
        return out
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(
        out,
        GEMMA3_TOKENS,
        plain=("\n", "\n\n", "\n\n\n", "\n\n\n\n"),
        eos="<eos>",
        pad="<pad>",
        chat_template=None,
        boi_token="<start_of_image>",
        eoi_token="<end_of_image>",
        image_token="<image_soft_token>",
    )
    torch.manual_seed(seed)
    config = Gemma3Config(
        text_config={
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": len(layer_types),
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": sliding_window,
            "layer_types": list(layer_types),
            "max_position_embeddings": max_position_embeddings,
            # 0.25 makes this model's greedy output degenerate; 0.03 does not.
            "initializer_range": 0.03,
            "bos_token_id": ids["<bos>"],
            "eos_token_id": ids["<eos>"],
            "pad_token_id": ids["<pad>"],
        },
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 224,
            "patch_size": 14,
            "vision_use_head": False,
        },
        mm_tokens_per_image=64,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        initializer_range=0.03,
        tie_word_embeddings=False,
    )
    config.dtype = torch.bfloat16
    model = Gemma3ForConditionalGeneration(config).to(torch.bfloat16)
    _save(model, out, (("vision_tower.", "vision_tower.vision_model."),))
    _write_json(
        out,
        "preprocessor_config.json",
        {
            "image_processor_type": "Gemma3ImageProcessorPil",
            "processor_class": "Gemma3Processor",
            "do_resize": True,
            "size": {"height": 224, "width": 224},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_convert_rgb": True,
            "do_pan_and_scan": False,
        },
    )
    _write_json(
        out,
        "processor_config.json",
        {"processor_class": "Gemma3Processor", "image_seq_length": 64},
    )
    (out / ".complete").touch()
    return out


QWEN2_AUDIO_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_bos|>",
    "<|AUDIO|>",
    "<|audio_eos|>",
]


def build_qwen2_audio_model(out: Path, seed: int = 0) -> Path:
    """A tiny Qwen2AudioForConditionalGeneration (2-layer Whisper-style encoder, d_model 64).

    Audio is 16 kHz mono; one second of it becomes 25 ``<|AUDIO|>`` placeholder tokens
    (100 mel frames, conv stride 2, pooling 2). Prompt format:
    ``<|audio_bos|><|AUDIO|><|audio_eos|>``.
    """
    if _done(out):
        return out
    import torch
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(out, QWEN2_AUDIO_TOKENS, chat_template=None)
    torch.manual_seed(seed)
    text = _text_config_kwargs(ids)
    text.update(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config = Qwen2AudioConfig(
        text_config=text,
        audio_config={
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "d_model": 64,
            "max_source_positions": 1500,
            "initializer_range": 0.25,
        },
        audio_token_index=ids["<|AUDIO|>"],
        tie_word_embeddings=False,
    )
    config.dtype = torch.bfloat16
    model = Qwen2AudioForConditionalGeneration(config).to(torch.bfloat16)
    _save(model, out, (("language_model.model.model.", "language_model.model."),))
    _write_json(
        out,
        "preprocessor_config.json",
        {**WHISPER_FEATURES, "processor_class": "Qwen2AudioProcessor"},
    )
    (out / ".complete").touch()
    return out


MISTRAL3_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
]


def build_mistral3_model(out: Path, seed: int = 0) -> Path:
    """A tiny Mistral3ForConditionalGeneration: 2-layer Pixtral ViT + 2-layer Mistral decoder.

    A 224x224 image is resized to 112x112: 8x8 patches of 14 px, merged 2x2 into 4 rows
    of 4 ``[IMG]`` tokens, each row closed by ``[IMG_BREAK]`` (the last by ``[IMG_END]``):
    20 placeholder tokens.
    """
    if _done(out):
        return out
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(out, MISTRAL3_TOKENS, eos="</s>", pad="<unk>", chat_template=None)
    torch.manual_seed(seed)
    text = _llama_text_config(ids, "</s>", "<unk>")
    text.update(model_type="mistral", head_dim=64, sliding_window=None, bos_token_id=ids["<s>"])
    config = Mistral3Config(
        text_config=text,
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 32,
            "image_size": 112,
            "patch_size": 14,
            "initializer_range": 0.25,
        },
        image_token_index=ids["[IMG]"],
        spatial_merge_size=2,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    config.dtype = torch.bfloat16
    _save(Mistral3ForConditionalGeneration(config).to(torch.bfloat16), out)
    _write_json(
        out,
        "preprocessor_config.json",
        {
            "image_processor_type": "PixtralImageProcessorPil",
            "processor_class": "PixtralProcessor",
            "do_resize": True,
            "size": {"longest_edge": 112},
            "patch_size": 14,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "do_convert_rgb": True,
        },
    )
    _write_json(
        out,
        "processor_config.json",
        {
            "processor_class": "PixtralProcessor",
            "patch_size": 14,
            "spatial_merge_size": 2,
            "image_token": "[IMG]",
            "image_break_token": "[IMG_BREAK]",
            "image_end_token": "[IMG_END]",
        },
    )
    (out / ".complete").touch()
    return out


IDEFICS3_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]


def build_idefics3_model(out: Path, seed: int = 0) -> Path:
    """A tiny Idefics3ForConditionalGeneration (SmolVLM's class): 2-layer SigLIP-style ViT
    (112 px, patch 14) + 2-layer Llama, pixel shuffle 2, no image splitting.

    An image becomes ``<fake_token_around_image><global-img>``, 16 ``<image>`` tokens and
    ``<fake_token_around_image>``: 19 placeholder tokens.
    """
    if _done(out):
        return out
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(
        out, IDEFICS3_TOKENS, eos="<end_of_utterance>", pad="<|endoftext|>", chat_template=None
    )
    torch.manual_seed(seed)
    config = Idefics3Config(
        text_config=_llama_text_config(ids, "<end_of_utterance>", "<|endoftext|>"),
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 112,
            "patch_size": 14,
            "initializer_range": 0.25,
        },
        scale_factor=2,
        image_token_id=ids["<image>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    config.dtype = torch.bfloat16
    _save(Idefics3ForConditionalGeneration(config).to(torch.bfloat16), out)
    _write_json(
        out,
        "preprocessor_config.json",
        {
            "image_processor_type": "Idefics3ImageProcessorPil",
            "processor_class": "Idefics3Processor",
            "do_resize": True,
            "size": {"longest_edge": 112},
            "max_image_size": {"longest_edge": 112},
            "do_image_splitting": False,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_pad": True,
            "do_convert_rgb": True,
        },
    )
    _write_json(
        out, "processor_config.json", {"processor_class": "Idefics3Processor", "image_seq_len": 16}
    )
    (out / ".complete").touch()
    return out


QWEN2_5_OMNI_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
]


def build_qwen2_5_omni_model(out: Path, seed: int = 0) -> Path:
    """A tiny Qwen2.5-Omni whose thinker vLLM serves as
    Qwen2_5OmniThinkerForConditionalGeneration (config.json: ``Qwen2_5OmniModel``, no
    talker): the Qwen2.5-VL ViT and decoder above plus a 2-layer Whisper-style audio
    encoder. A 224x224 image is 64 ``<|IMAGE|>`` tokens, inside
    ``<|vision_bos|>...<|vision_eos|>``.
    """
    if _done(out):
        return out
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniThinkerForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    names = {
        "image_token": "<|IMAGE|>",
        "audio_token": "<|AUDIO|>",
        "video_token": "<|VIDEO|>",
        "vision_bos_token": "<|vision_bos|>",
        "vision_eos_token": "<|vision_eos|>",
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
    }
    ids = _write_tokenizer(out, QWEN2_5_OMNI_TOKENS, chat_template=None, **names)
    torch.manual_seed(seed)
    text = _text_config_kwargs(ids)
    text["rope_parameters"] = dict(MROPE_PARAMETERS)
    thinker = {
        "text_config": text,
        "vision_config": dict(QWEN2_5_VIT),
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "d_model": 64,
            "output_dim": 128,
            "max_source_positions": 1500,
            "n_window": 100,
            "initializer_range": 0.25,
        },
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
        "user_token_id": ids["<|im_start|>"],
        "initializer_range": 0.25,
        "tie_word_embeddings": False,
    }
    config = Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    config.architectures = ["Qwen2_5OmniModel"]
    config.dtype = torch.bfloat16
    model = Qwen2_5OmniThinkerForConditionalGeneration(config.thinker_config)
    # vLLM loads the thinker's weights under "thinker." (the full model's names).
    _save(model.to(torch.bfloat16), out, (("", "thinker."),))
    config.save_pretrained(str(out))  # the full model's config.json over the thinker's
    _write_json(
        out,
        "preprocessor_config.json",
        {**QWEN_IMAGE_PROCESSOR, **WHISPER_FEATURES, "processor_class": "Qwen2_5OmniProcessor"},
    )
    (out / ".complete").touch()
    return out
