"""The KV cache layouts of vLLM 0.32's attention backends: one explicit description each.

vLLM 0.32 hands the connector every attention layer's KV cache as one 4-D view that is
logically ``[blocks, heads, tokens, content]`` whatever the backend
(``vllm/v1/kv_cache_interface.py``: ``create_kv_cache_views``); all layers sit in one
backing allocation whose physical order of the five logical axes ``L, B, H, N, C``
(layer, block, head, token, content) is one ``KVCacheLayout`` resolved for the whole
engine from the layouts its backends accept (``resolve_kv_cache_layout``). What the
bytes of a page mean is then two independent things, described here:

``KVOrder`` (where each axis sits; vLLM's ``KVCacheLayout`` names)::

    LBHNC  layer-major, a block's page [heads, tokens, content]   HND: CPU_ATTN, FlashInfer's HND
    LBNHC  layer-major, a block's page [tokens, heads, content]   NHD: vLLM's default for backends
                                                                  without a preference (FLASH_ATTN,
                                                                  FLASHINFER, TRITON_ATTN); FLEX_ATTENTION
    LHBNC  layer-major, each head's plane spans every block       ROCm
    BLHNC  cross-layer: a block holds every layer's page (HND)    FlashInfer on Blackwell, B12X
    BLNHC  cross-layer (NHD)                                       VLLM_KV_CACHE_LAYOUT, DeepSeek-V4
    BHLNC  cross-layer, heads outside layers                      VLLM_KV_CACHE_LAYOUT

In every one the block axis of a layer's view is axis 0 (with kernel blocks smaller
than the engine's block, ``blocks x r`` kernel blocks, ``r`` of them per block).

``KVContent`` (what the content axis holds; the *family* is chosen from the attention
backend vLLM reports for the layers, ``BACKENDS``)::

    kv   per token, K (head_size values) then V (head_size_v): FLASH_ATTN, FLASHINFER,
         TRITON_ATTN, FLEX_ATTENTION, ... (``kv_cache.transpose(1, 2).split(head_size, -1)``)
    cpu  CPU_ATTN: each head's page [tokens, 2 * head_size] is read as [2 * tokens, head_size]:
         the K of every token of the block, then their V (``view(B, H, 2 * N, -1).chunk(2, 2)``)
    mla  one latent vector per token, no V, one head: every MLA backend (the MLA layer
         writes ``[kv_lora_rank latent | rope dims]``, ``concat_and_cache_mla``)

A chunk's payload is the chunk's blocks of every layer in the *logical* order
``[layers, blocks, heads, tokens, content]`` whatever the physical order, so an engine
on FlashAttention (LBNHC) and one on FlashInfer (LBHNC) read each other's chunks; the
content family, head counts and sizes are what the keys pin (``KVContent.pinned``), so
chunks of different content never share a key. On the CPU backend the payload is
byte-for-byte what it was before these descriptions (LBHNC is its physical order).

This module imports torch but not vLLM (the GPU benchmark uses it without vLLM).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

import torch

from kvtier.connector.chunks.codec import DTYPE_SIZES
from kvtier.connector.errors import ConfigError

__all__ = ["BACKENDS", "FAMILIES", "ORDERS", "BlockView", "KVContent", "KVOrder", "allocate"]

_L, _B, _H, _N, _C = range(5)

ORDERS: Final[Mapping[str, tuple[int, ...]]] = MappingProxyType(
    {
        "LBHNC": (_L, _B, _H, _N, _C),
        "LBNHC": (_L, _B, _N, _H, _C),
        "LHBNC": (_L, _H, _B, _N, _C),
        "BLHNC": (_B, _L, _H, _N, _C),
        "BLNHC": (_B, _L, _N, _H, _C),
        "BHLNC": (_B, _H, _L, _N, _C),
    }
)
"""vLLM 0.32's ``KVCacheLayout`` members: the logical axes ``L, B, H, N, C`` outermost first."""

FAMILIES: Final = ("kv", "cpu", "mla")

BACKENDS: Final[Mapping[str, str]] = MappingProxyType(
    {
        # K then V per token, split at head_size (read in each backend's forward).
        "FLASH_ATTN": "kv",
        "FLASH_ATTN_DIFFKV": "kv",
        "FLASHINFER": "kv",
        "TRITON_ATTN": "kv",
        "FLEX_ATTENTION": "kv",
        "HPC_ATTN": "kv",
        "ROCM_AITER_UNIFIED_ATTN": "kv",
        # Each head's page read as [2 * tokens, head_size]: all K, then all V.
        "CPU_ATTN": "cpu",
        # One latent per token, written by the MLA layer (concat_and_cache_mla or its CPU twin).
        "FLASHMLA": "mla",
        "FLASH_ATTN_MLA": "mla",
        "FLASHINFER_MLA": "mla",
        "CUTLASS_MLA": "mla",
        "TRITON_MLA": "mla",
        "ROCM_AITER_MLA": "mla",
        "AITER_TRITON_MLA": "mla",
        "CPU_MLA": "mla",
    }
)
"""Attention backends (``AttentionBackend.get_name()``) whose KV content kvtier knows, and its
family. Another backend (ROCM_ATTN's x-packed pages, the sparse MLA indexers, quantizing
backends such as TURBOQUANT) is refused at start, naming it."""


@dataclass(frozen=True)
class KVOrder:
    """The physical order of the engine's KV allocation: one of vLLM's ``KVCacheLayout``."""

    name: str
    axes: tuple[int, ...]
    """The logical axes ``L, B, H, N, C`` (0-4), outermost first."""

    @classmethod
    def named(cls, name: str) -> KVOrder:
        """The order vLLM calls ``name``; ``ConfigError`` for one kvtier does not know."""
        if name not in ORDERS:
            raise ConfigError(
                f"kvtier does not know the KV cache layout {name!r} (vLLM's "
                f"cache_config.kv_cache_layout); known: {', '.join(ORDERS)}"
            )
        return cls(name, ORDERS[name])

    @property
    def cross_layer(self) -> bool:
        """True when a block holds the pages of every layer (the layer axis is not outermost)."""
        return self.axes[0] != _L

    @property
    def view_axes(self) -> tuple[int, ...]:
        """The axes of one layer's ``[B, H, N, C]`` view (0-3), outermost first."""
        return tuple(axis - 1 for axis in self.axes if axis != _L)

    def matches(self, view: torch.Tensor) -> bool:
        """Whether a layer's ``[B, H, N, C]`` view is laid out in this order: its strides
        shrink along ``view_axes`` (pages may be padded, layers interleaved), C is dense.
        Axes of size 1 have no order to check."""
        if view.dim() != 4 or (view.shape[3] > 1 and view.stride(3) != 1):
            return False
        sized = [a for a in self.view_axes if view.shape[a] > 1]
        return all(
            view.stride(outer) >= view.stride(inner) * view.shape[inner]
            for outer, inner in itertools.pairwise(sized)
        )


@dataclass(frozen=True)
class KVContent:
    """What a block's page holds: ``heads x tokens x width`` values of ``dtype`` (per rank)."""

    family: str
    """One of ``FAMILIES``: where K and V sit (see the module docstring)."""
    heads: int
    """KV heads of this rank (1 for MLA)."""
    tokens: int
    """Tokens per block (the engine's block size)."""
    head_size: int
    """Width of K (MLA: of the latent, kv_lora_rank + rope dims)."""
    head_size_v: int
    """Width of V (0 for MLA)."""
    dtype: str
    """The stored values' torch dtype name (``uint8`` for fp8 caches)."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"KV content family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        for name in ("heads", "tokens", "head_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"KVContent.{name} must be >= 1, got {getattr(self, name)}")
        if (self.family == "mla") != (self.head_size_v == 0) or self.head_size_v < 0:
            raise ConfigError(f"KVContent: head_size_v={self.head_size_v} does not fit {self.family!r}")
        if self.family == "cpu" and self.head_size_v != self.head_size:
            raise ConfigError("KVContent: CPU_ATTN stores K and V of one head size")
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(f"KVContent.dtype must be one of {', '.join(DTYPE_SIZES)}, got {self.dtype!r}")

    @property
    def width(self) -> int:
        """Values on the content axis: ``head_size + head_size_v``."""
        return self.head_size + self.head_size_v

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return self.heads * self.tokens * self.width * DTYPE_SIZES[self.dtype]

    def pinned(self, device_type: str, layers: int) -> str:
        """The ``KeySpec.kv_layout`` of an engine with this content: the same string for
        every engine whose chunk payloads mean the same bytes (the physical order is not in
        it: payloads are in logical order). ``device_type:layers=..:kv_heads=..:head_size=..``
        as before these descriptions (so CPU_ATTN keys did not change), then ``:head_size_v=``
        when V is narrower or wider than K, and ``:mla`` for a latent cache."""
        text = f"{device_type}:layers={layers}:kv_heads={self.heads}:head_size={self.head_size}"
        if self.family == "kv" and self.head_size_v != self.head_size:
            text += f":head_size_v={self.head_size_v}"
        return text + (":mla" if self.family == "mla" else "")

    def split(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K and V of logical pages ``[..., heads, tokens, width]`` as ``[..., heads, tokens,
        head_size]`` views (V is None for MLA): where each family keeps them."""
        if self.family == "mla":
            return pages, None
        if self.family == "cpu":
            rows = pages.reshape(*pages.shape[:-2], 2 * self.tokens, self.head_size)
            return rows[..., : self.tokens, :], rows[..., self.tokens :, :]
        return pages[..., : self.head_size], pages[..., self.head_size :]


def family_of(backends: Sequence[str]) -> str:
    """The content family of layers run by ``backends`` (their ``get_name()``); ``ConfigError``
    naming a backend kvtier does not know, or layers whose backends store KV differently."""
    unknown = sorted({b for b in backends if b not in BACKENDS})
    if unknown:
        raise ConfigError(
            f"kvtier does not know the KV cache layout of attention backend(s) "
            f"{', '.join(unknown)}; known: {', '.join(BACKENDS)} (choose one with "
            "--attention-backend)"
        )
    families = {BACKENDS[b] for b in backends}
    if len(families) != 1:
        raise ConfigError(f"attention backends {sorted(set(backends))} store KV differently")
    return families.pop()


class BlockView:
    """One layer's KV cache as whole engine blocks: ``gather`` and ``scatter`` move
    ``[k, heads, tokens, width]`` in logical order, whatever the physical order.

    vLLM may run kernels on blocks smaller than the engine's (``r`` kernel blocks per
    engine block, ``blocks x r`` in the view): block ``b`` is kernel blocks
    ``b*r .. b*r+r-1``, its tokens in that order, so the view is regrouped as
    ``[blocks, heads, r, tokens/r, width]`` (what vLLM's ``group_kernel_blocks`` does,
    heads moved out)."""

    def __init__(self, layer: torch.Tensor, num_blocks: int) -> None:
        self.layer = layer
        ratio = layer.shape[0] // num_blocks
        self.ratio = ratio
        if ratio == 1:
            self._view = layer
        else:
            self._view = layer.unflatten(0, (num_blocks, ratio)).transpose(1, 2)
        heads, tokens, width = layer.shape[1], layer.shape[2] * ratio, layer.shape[3]
        self.page_shape = (heads, tokens, width)

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """Blocks ``index`` (a long tensor on the layer's device) as a new contiguous
        ``[k, heads, tokens, width]`` tensor."""
        return self._view.index_select(0, index).reshape(len(index), *self.page_shape)

    def scatter(self, index: torch.Tensor, pages: torch.Tensor) -> None:
        """Writes ``pages`` (``[k, heads, tokens, width]``, contiguous) into blocks ``index``."""
        self._view.index_copy_(0, index, pages.view(len(index), *self._view.shape[1:]))


def allocate(
    order: KVOrder,
    content: KVContent,
    *,
    layers: int,
    blocks: int,
    device: torch.device | str = "cpu",
    kernel_tokens: int | None = None,
) -> list[torch.Tensor]:
    """KV caches laid out as vLLM 0.32 allocates them (``allocate_kv_cache`` with
    ``create_kv_cache_views``): one zeroed int8 backing buffer, one ``[B, H, N, C]``
    view per layer with the strides of ``order``; ``kernel_tokens``: kernel blocks of
    that many tokens (``blocks x r`` of them). For tests and the GPU benchmark, which
    run without vLLM; tests/connector/test_kv_layouts.py checks it against vLLM's own."""
    dtype = getattr(torch, content.dtype)
    ratio = 1 if kernel_tokens is None else content.tokens // kernel_tokens
    if ratio < 1 or content.tokens % ratio:
        raise ConfigError(f"kernel_tokens={kernel_tokens} must divide {content.tokens}")
    shape = (layers, blocks * ratio, content.heads, content.tokens // ratio, content.width)
    strides = [0] * 5
    step = 1
    for axis in reversed(order.axes):
        strides[axis] = step
        step *= shape[axis]
    size = math.prod(shape) * DTYPE_SIZES[content.dtype]
    backing = torch.zeros(size, dtype=torch.int8, device=device).view(dtype)
    whole = torch.as_strided(backing, shape, strides)
    return [whole[layer] for layer in range(layers)]
