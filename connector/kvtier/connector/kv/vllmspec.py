"""The engine's KV cache as vLLM describes it, read: its KV cache groups, what their pages
hold, and the keys their chunks get.

``engine_groups`` turns vLLM's ``KVCacheConfig`` into one ``KVGroup`` per KV cache group
(what it keeps: ``kvtier.connector.kv.groups``) with its ``KeySpec`` per tensor-parallel
rank, and one ``KVContent`` per group (what a page of its layers holds:
``kvtier.connector.kv.layouts``). A key's ``kv_layout`` is the content's
``KVContent.pinned`` string, then, for every group but an engine's lone full-attention
one, ``:group=<tag>:layer_set=<digest>``: an engine with one group keeps the keys it had
before groups existed (docs/keys.md). vLLM is imported inside the functions (the
connector front calls them in vLLM's processes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from kvtier.connector.chunks.keys import KeySpec
from kvtier.connector.config import ConnectorConfig, check_item_identifiers
from kvtier.connector.errors import ConfigError
from kvtier.connector.kv.groups import CHUNKED_LOCAL, FULL, SLIDING_WINDOW, KVGroup
from kvtier.connector.kv.layouts import KVContent

__all__ = ["backends", "engine_groups", "retention", "value_dtypes"]


def engine_groups(
    config: ConnectorConfig, vllm_config: Any, kv_cache_config: Any
) -> tuple[list[KVGroup], list[KVContent]]:
    """The engine's KV cache groups, each with its key spec per tensor-parallel rank, and
    what each group's pages hold; ``ConfigError`` for what kvtier cannot store."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError("kvtier does not support pipeline parallelism yet")
    check_item_identifiers(vllm_config, "KvtierConnector")
    model = vllm_config.model_config
    vllm_groups = kv_cache_config.kv_cache_groups
    if not vllm_groups:
        raise ConfigError("kvtier stores attention KV caches; this model has no KV cache group")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    groups, contents = [], []
    for index, group in enumerate(vllm_groups):
        spec = group.kv_cache_spec
        kind, window, extra = retention(spec, index, len(vllm_groups))
        content = _content(spec, vllm_config)
        config.check_block_size(content.tokens)
        tag = KVGroup.describe(index, len(vllm_groups), kind, window, extra)
        layout = content.pinned(current_platform.device_type, len(group.layer_names))
        if tag:  # the group, and which layers it holds (a lone full group: as before)
            digest = hashlib.sha256("\n".join(group.layer_names).encode()).hexdigest()[:16]
            layout += f":group={tag}:layer_set={digest}"
        # An fp8 cache holds uint8 bytes: the cache dtype says which fp8 they are.
        kv_dtype = cache_dtype if cache_dtype.startswith("fp8") else content.dtype
        tp = parallel.tensor_parallel_size
        specs = tuple(
            KeySpec(
                model_id=config.model_id or model.model,
                model_revision=model.revision or "",
                kv_dtype=kv_dtype,
                kv_layout=layout,
                block_size=content.tokens,
                chunk_size=config.chunk_size,
                tp_rank=rank,
                tp_world_size=tp,
                hash_algo=config.hash_algo,
                salt=config.salt or "",
            )
            for rank in range(tp)
        )
        groups.append(
            KVGroup(content.tokens, kind, window, extra, tag, specs, tuple(group.layer_names))
        )
        contents.append(content)
    return groups, contents


def value_dtypes(vllm_config: Any, contents: Sequence[KVContent]) -> list[str]:
    """Per group, the dtype the NaN scan (chunks/finite.py) reads its pages as: the stored
    dtype, or for an fp8 cache (uint8 bytes) ``float8_e4m3fn``, whose only non-finite bytes
    are 0x7F and 0xFF. Those are NaN in e5m2 too, and never finite in either, so
    ``fp8_e5m2`` is scanned the same way: vLLM's backends differ in which fp8 they write
    for it (TRITON_ATTN writes the platform's e4m3, where e5m2's infinity and NaN masks
    would match the finite 384 to 448), and e5m2's infinities and other NaNs go unfound.
    ``""`` (not scanned) where the platform's e4m3 is e4m3fnuz (ROCm MI300: 0x7F is 240,
    its NaN 0x80), and for any other cache of uint8 bytes (quantized formats with packed
    scales, whose bytes are not all values)."""
    import torch
    from vllm.platforms import current_platform

    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    fp8 = cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2")
    value = "float8_e4m3fn" if fp8 and current_platform.fp8_dtype() == torch.float8_e4m3fn else ""
    return [value if c.dtype == "uint8" else c.dtype for c in contents]


def retention(spec: Any, index: int, count: int) -> tuple[str, int, int]:
    """What a KV cache group keeps: its kind, window and extra tokens (``KVGroup``)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    if isinstance(spec, SlidingWindowSpec):
        return SLIDING_WINDOW, spec.sliding_window, spec.extra_retained_tokens
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return CHUNKED_LOCAL, spec.attention_chunk_size, 0
    if isinstance(spec, FullAttentionSpec) or (count == 1 and hasattr(spec, "num_kv_heads")):
        return FULL, 0, 0  # a lone attention group of another kind: stored whole, as before
    raise ConfigError(
        f"kvtier stores attention KV caches (full, sliding-window or chunked local "
        f"attention); KV cache group {index} of {count} is {type(spec).__name__}"
    )


def _content(spec: Any, vllm_config: Any) -> KVContent:
    """What a group's KV pages hold (kv/layouts.py). The content family follows the
    platform (CPU_ATTN on the CPU, K|V-per-token backends on a GPU) or MLA; the worker
    checks the backends vLLM chose agree (``backends``)."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import KVQuantMode, MLAAttentionSpec

    if not hasattr(spec, "num_kv_heads"):
        raise ConfigError(f"kvtier supports attention KV caches, not {type(spec).__name__}")
    mode = getattr(spec, "kv_quant_mode", KVQuantMode.NONE)
    if mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
        raise ConfigError(
            f"kvtier does not store {mode.name} KV caches (--kv-cache-dtype "
            f"{vllm_config.cache_config.cache_dtype}); use auto, bfloat16, float16 or an fp8 "
            "type with per-tensor scales"
        )
    if (
        getattr(spec, "state_content_bytes", None) is not None
        or getattr(spec, "num_head_slots", None) is not None
        or getattr(spec, "tokens_per_state", 1) != 1
    ):
        raise ConfigError(
            f"kvtier does not store packed KV pages ({type(spec).__name__} with a backend's "
            "own page packing)"
        )
    mla = isinstance(spec, MLAAttentionSpec)
    family = "mla" if mla else ("cpu" if current_platform.device_type == "cpu" else "kv")
    return KVContent(
        family=family,
        heads=spec.num_kv_heads,
        tokens=spec.block_size,
        head_size=spec.head_size,
        head_size_v=0 if mla else spec.head_size_v,
        dtype=str(spec.dtype).removeprefix("torch."),
    )


def backends(vllm_config: Any, layer_names: list[str]) -> list[str]:
    """The attention backend (``get_name()``) of each named layer vLLM built."""
    context = vllm_config.compilation_config.static_forward_context
    names = []
    for name in layer_names:
        backend = getattr(context.get(name), "attn_backend", None)
        if backend is None:
            raise ConfigError(f"kvtier: cannot tell the attention backend of KV layer {name}")
        names.append(str(backend.get_name()))
    return names
