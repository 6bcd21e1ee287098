"""The KV layouts of vLLM 0.32's GPU attention backends (kv/layouts.py), on CPU tensors.

The caches are made by vLLM's own ``create_kv_cache_views`` (what ``allocate_kv_cache``
does on a GPU), with the shapes of the GPU backends; the references write and read K
and V with each backend's own expressions (FlashAttention's ``transpose(1, 2).split``,
CPU_ATTN's ``view(..., 2 * N, -1).chunk(2, 2)``, MLA's one latent per token), never
through kvtier's code. The layout logic is device-agnostic: torch runs the same
``index_select``/``index_copy_`` on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtier.connector.chunks.keys import KeySpec, chunk_keys
from kvtier.connector.client import TierClient
from kvtier.connector.client.breaker import CircuitBreaker
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.errors import ConfigError
from kvtier.connector.kv.layouts import (
    BACKENDS,
    ORDERS,
    BlockView,
    KVContent,
    KVOrder,
    allocate,
    family_of,
)
from kvtier.connector.kv.worker import KvtierWorker
from kvtier.connector.metrics import KV, Recorder

LAYERS, BLOCKS = 3, 10


@dataclass(frozen=True)
class Shape:
    """A GPU backend's KV cache, small enough for the CPU."""

    backend: str
    order: str
    content: KVContent
    kernel_tokens: int | None = None


def _kv(heads: int, tokens: int, k: int, v: int, dtype: str = "bfloat16") -> KVContent:
    return KVContent("kv", heads, tokens, k, v, dtype)


SHAPES = [
    Shape("FLASH_ATTN", "LBNHC", _kv(8, 16, 128, 128)),  # Llama-3-8B per rank (TP 1), NHD
    Shape("FLASHINFER", "LBHNC", _kv(8, 16, 128, 128, "float16")),  # HND
    Shape("FLASHINFER", "BLHNC", _kv(4, 16, 64, 64)),  # Blackwell trtllm-gen: cross-layer
    Shape("TRITON_ATTN", "BLNHC", _kv(2, 16, 64, 64)),  # VLLM_KV_CACHE_LAYOUT=BLNHC
    Shape("FLEX_ATTENTION", "BHLNC", _kv(2, 16, 64, 64)),
    Shape("ROCM_AITER_UNIFIED_ATTN", "LHBNC", _kv(2, 16, 64, 64)),
    Shape("FLASH_ATTN", "LBNHC", _kv(4, 16, 128, 128, "uint8")),  # fp8_e4m3 cache
    Shape("FLASH_ATTN_DIFFKV", "LBNHC", _kv(2, 16, 128, 64)),  # V narrower than K
    Shape("FLASHINFER", "LBHNC", _kv(2, 64, 64, 64), kernel_tokens=16),  # 4 kernel blocks/block
    Shape("FLASHMLA", "LBNHC", KVContent("mla", 1, 64, 576, 0, "bfloat16")),  # DeepSeek latent
    Shape("TRITON_MLA", "BLHNC", KVContent("mla", 1, 16, 576, 0, "bfloat16")),
    Shape("CPU_ATTN", "LBHNC", KVContent("cpu", 2, 128, 64, 64, "bfloat16")),
]
IDS = [f"{s.backend}-{s.order}-{s.content.dtype}{'-kernel' if s.kernel_tokens else ''}" for s in SHAPES]


def vllm_caches(shape: Shape) -> list[torch.Tensor]:
    """The layers' views exactly as vLLM 0.32 allocates them (``create_kv_cache_views``)."""
    c = shape.content
    dtype = getattr(torch, c.dtype)
    if c.family == "mla":
        spec = MLAAttentionSpec(block_size=c.tokens, num_kv_heads=1, head_size=c.head_size, dtype=dtype)
    else:
        spec = FullAttentionSpec(
            block_size=c.tokens, num_kv_heads=c.heads, head_size=c.head_size,
            head_size_v=c.head_size_v, dtype=dtype,
        )  # fmt: skip
    layout = KVCacheLayout[shape.order]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    tensor = KVCacheTensor(
        size=LAYERS * BLOCKS * spec.page_size_bytes, layers=names,
        layer_stride=layer_stride, block_stride=block_stride,
    )  # fmt: skip
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel_block_size=shape.kernel_tokens)


def backend_kv(shape: Shape, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K and V of every block as ``[blocks, heads, r, tokens/r, size]`` views, found the way
    the backend finds them (r kernel blocks per block)."""
    c = shape.content
    ratio = layer.shape[0] // BLOCKS
    if c.family == "cpu":  # CPU_ATTN: kv_cache.view(B, H, 2 * N, -1).chunk(2, dim=2)
        k, v = layer.view(layer.shape[0], c.heads, 2 * c.tokens, -1).chunk(2, dim=2)
        return k.unsqueeze(2), v.unsqueeze(2)

    def grouped(part: torch.Tensor) -> torch.Tensor:  # [B*r, N', H, w] -> [B, H, r, N', w]
        return part.unflatten(0, (BLOCKS, ratio)).permute(0, 3, 1, 2, 4)

    if c.family == "mla":  # one latent per token: the whole content axis
        return grouped(layer.transpose(1, 2)), None
    k, v = layer.transpose(1, 2).split(c.head_size, dim=-1)  # FlashAttention, FlashInfer, ...
    return grouped(k), grouped(v)


def reference(shape: Shape, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random K and V of every block, ``[blocks, heads, tokens, size]``."""
    c = shape.content
    gen = torch.Generator().manual_seed(seed)

    def rand(width: int) -> torch.Tensor:
        values = torch.randint(0, 250, (BLOCKS, c.heads, c.tokens, width), generator=gen)
        return values.to(getattr(torch, c.dtype))

    return rand(c.head_size), (rand(c.head_size_v) if c.head_size_v else None)


def write(shape: Shape, layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
    """Write K and V of every block the way the backend reads them."""
    bk, bv = backend_kv(shape, layer)
    bk.copy_(k.view(bk.shape))
    if bv is not None and v is not None:
        bv.copy_(v.view(bv.shape))


def read(shape: Shape, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    bk, bv = backend_kv(shape, layer)
    c = shape.content
    flat = (BLOCKS, c.heads, c.tokens, -1)
    return bk.reshape(flat), (bv.reshape(flat) if bv is not None else None)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_allocate_lays_caches_out_as_vllm_does(shape: Shape) -> None:
    ours = allocate(
        KVOrder.named(shape.order), shape.content, layers=LAYERS, blocks=BLOCKS,
        kernel_tokens=shape.kernel_tokens,
    )  # fmt: skip
    for mine, theirs in zip(ours, vllm_caches(shape), strict=True):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
        assert mine.stride() == theirs.stride()
        assert mine.storage_offset() == theirs.storage_offset()


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_gather_yields_each_blocks_k_and_v_where_the_content_family_says(shape: Shape) -> None:
    caches = vllm_caches(shape)
    refs = [reference(shape, seed) for seed in range(LAYERS)]
    for layer, (k, v) in zip(caches, refs, strict=True):
        write(shape, layer, k, v)
    blocks = [7, 2, 5]
    index = torch.tensor(blocks)

    for layer, (k, v) in zip(caches, refs, strict=True):
        pages = BlockView(layer, BLOCKS).gather(index)
        assert pages.is_contiguous()
        assert pages.shape == (3, shape.content.heads, shape.content.tokens, shape.content.width)
        got_k, got_v = shape.content.split(pages)
        assert torch.equal(got_k, k[blocks])
        if v is not None:
            assert got_v is not None and torch.equal(got_v, v[blocks])
        else:
            assert got_v is None


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_scatter_writes_only_the_target_blocks_readable_by_the_backend(shape: Shape) -> None:
    source = vllm_caches(shape)
    refs = [reference(shape, seed) for seed in range(LAYERS)]
    for layer, (k, v) in zip(source, refs, strict=True):
        write(shape, layer, k, v)
    target = vllm_caches(shape)
    src, dst = [1, 4], [9, 0]

    for from_layer, to_layer in zip(source, target, strict=True):
        pages = BlockView(from_layer, BLOCKS).gather(torch.tensor(src))
        BlockView(to_layer, BLOCKS).scatter(torch.tensor(dst), pages)

    for layer, (k, v) in zip(target, refs, strict=True):
        got_k, got_v = read(shape, layer)
        assert torch.equal(got_k[dst], k[src])
        if v is not None:
            assert got_v is not None and torch.equal(got_v[dst], v[src])
        others = [b for b in range(BLOCKS) if b not in dst]
        assert not got_k[others].any() and (got_v is None or not got_v[others].any())


ORDER_PAIRS = [("LBNHC", "LBHNC"), ("LBHNC", "BLNHC"), ("BHLNC", "LHBNC"), ("BLHNC", "LBNHC")]


@pytest.mark.parametrize(("saved", "loaded"), ORDER_PAIRS)
def test_a_chunk_gathered_in_one_order_means_the_same_in_another(saved: str, loaded: str) -> None:
    content = _kv(4, 16, 64, 64)
    a = Shape("FLASH_ATTN", saved, content)
    b = Shape("FLASHINFER", loaded, content)
    k, v = reference(a, 3)
    source, target = vllm_caches(a)[0], vllm_caches(b)[0]
    write(a, source, k, v)

    payload = BlockView(source, BLOCKS).gather(torch.arange(BLOCKS))
    BlockView(target, BLOCKS).scatter(torch.arange(BLOCKS), payload)

    got_k, got_v = read(b, target)
    assert torch.equal(got_k, k) and got_v is not None and torch.equal(got_v, v)


def test_every_order_vllm_knows_has_a_description() -> None:
    assert set(ORDERS) == {layout.name for layout in KVCacheLayout}
    for layout in KVCacheLayout:
        assert KVOrder.named(layout.name).axes == layout.stride_order
        assert KVOrder.named(layout.name).cross_layer == (not layout.is_layer_compact)


@pytest.mark.parametrize("name", ["NHD", "lbnhc", "LBCHN", ""])
def test_an_unknown_order_is_refused_naming_it_and_the_known_ones(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"layout '{name}'.*known: LBHNC, LBNHC"):
        KVOrder.named(name)


def test_an_unknown_backend_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"backend.*ROCM_ATTN; known: FLASH_ATTN"):
        family_of(["FLASH_ATTN", "ROCM_ATTN"])
    with pytest.raises(ConfigError, match="store KV differently"):
        family_of(["FLASH_ATTN", "CPU_ATTN"])
    assert family_of(["FLASHINFER", "FLASH_ATTN"]) == "kv" and family_of(["FLASHMLA"]) == "mla"
    assert set(BACKENDS.values()) == {"kv", "cpu", "mla"}


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_the_order_of_a_vllm_cache_is_recognised_from_its_strides(shape: Shape) -> None:
    layer = vllm_caches(shape)[1]
    assert KVOrder.named(shape.order).matches(layer)
    if shape.content.heads > 1:  # with one head, NHD and HND are the same bytes
        other = {"LBNHC": "LBHNC", "BLNHC": "BLHNC"}.get(shape.order, "LBNHC")
        assert not KVOrder.named(other).matches(layer)


def test_pinned_layout_strings_keep_cpu_keys_and_separate_contents() -> None:
    cpu = KVContent("cpu", 1, 128, 64, 64, "bfloat16")
    assert cpu.pinned("cpu", 2) == "cpu:layers=2:kv_heads=1:head_size=64"  # as before
    assert _kv(8, 16, 128, 128).pinned("cuda", 32) == "cuda:layers=32:kv_heads=8:head_size=128"
    assert _kv(8, 16, 128, 64).pinned("cuda", 32).endswith(":head_size_v=64")
    mla = KVContent("mla", 1, 64, 576, 0, "bfloat16").pinned("cuda", 61)
    dense = _kv(1, 64, 576, 576).pinned("cuda", 61)
    assert mla == dense + ":mla"
    keys = {
        text: chunk_keys(range(256), [], KeySpec(model_id="m", kv_layout=text, chunk_size=256))[0]
        for text in (mla, dense)
    }
    assert keys[mla] != keys[dense]


def worker(layers: int = LAYERS) -> KvtierWorker:
    """A worker whose tier is never called (registration makes no call)."""
    target = "127.0.0.1:9"
    return KvtierWorker(
        ConnectorConfig(target=target), TierClient(target), rank=0, num_blocks=BLOCKS,
        layer_order=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
        breaker=CircuitBreaker(3, 1.0), recorder=Recorder(KV),
    )  # fmt: skip


def named(caches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: Shape(s.backend, "LBHNC", s.content), "reported the LBHNC KV cache layout"),
        (lambda s: Shape(s.backend, s.order, _kv(4, 16, 128, 128)), r"expected \[num_blocks=10"),
        (lambda s: Shape(s.backend, s.order, _kv(8, 16, 128, 128, "float16")), "not float16"),
    ],
    ids=["other-order", "other-heads", "other-dtype"],
)
def test_the_worker_refuses_caches_that_do_not_fit_what_vllm_reported(
    change: Callable[[Shape], Shape], message: str
) -> None:
    shape = SHAPES[0]  # FlashAttention, LBNHC, 8 heads
    reported = change(shape)
    w = worker()
    try:
        with pytest.raises(ConfigError, match=message):
            w.register_kv_caches(
                named(vllm_caches(shape)),
                order=KVOrder.named(reported.order),
                content=reported.content,
            )
    finally:
        w.shutdown()


def test_the_worker_counts_a_layer_sharing_another_layers_cache_once() -> None:
    shape = SHAPES[1]
    caches = named(vllm_caches(shape))
    caches["model.layers.3.self_attn.attn"] = caches["model.layers.0.self_attn.attn"]
    w = worker(LAYERS + 1)
    try:
        w.register_kv_caches(caches, order=KVOrder.named(shape.order), content=shape.content)
        assert w.copier.layers == LAYERS
    finally:
        w.shutdown()
