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


def _write_tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=8192,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


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
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [8, 12, 12],
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config={
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
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.dtype = torch.bfloat16
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(str(out))
    preprocessor = {
        # transformers' PIL backend: needs no torchvision (uninstalled here, see docs/connector.md).
        "image_processor_type": "Qwen2VLImageProcessorPil",
        "processor_class": "Qwen2_5_VLProcessor",
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
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (out / ".complete").touch()
    return out
