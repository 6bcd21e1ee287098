"""NaN and infinities in a KV chunk's payload: found before the chunk is stored.

A tier shares one engine's KV with every engine that loads the same prefix, so a chunk
holding a NaN or an infinity (an overflow, a corrupted cache, a bug) would turn into
wrong output wherever it is loaded: vLLM's attention reads every slot of a block, and NaN
there makes every later token of the request wrong (docs/connector.md, "NaN and
infinities"). ``encode_chunk(..., check_finite=True)`` refuses such a
payload with ``NonFiniteChunk``; the worker drops that save and counts it.

An element is not finite when its exponent field is all ones (IEEE 754; float8_e4m3fn
has no infinity, and its NaN is exponent and mantissa all ones). Dtypes that are not
floating point (int8, uint8) are never scanned; vLLM keeps an fp8 KV cache as uint8 bytes,
and the connector scans those for the bytes that are NaN in every fp8 it may hold
(``kv/vllmspec.value_dtypes``; not on ROCm's e4m3fnuz, whose NaN is 0x80, which no mask
test finds). The scan runs in C where ``_finite``
(connector/kvtier/connector/chunks/_finite.c) is built, else with numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["NONFINITE_BITS", "first_nonfinite", "first_nonfinite_py"]

_finite: ModuleType | None
try:  # the C scan (connector/kvtier/connector/chunks/_finite.c), built by pip when it can
    from kvtier.connector.chunks import _finite
except ImportError:  # pragma: no cover - the pure-Python scan below
    _finite = None

NONFINITE_BITS: Final[Mapping[str, tuple[int, int]]] = MappingProxyType(
    {
        "bfloat16": (2, 0x7F80),
        "float16": (2, 0x7C00),
        "float32": (4, 0x7F800000),
        "float8_e4m3fn": (1, 0x7F),
        "float8_e5m2": (1, 0x7C),
    }
)
"""Per floating-point dtype: (item size, the bits that are all ones in a NaN or an infinity)."""

_NUMPY_BLOCK = 1 << 16  # elements per numpy pass: its temporaries stay in cache


def first_nonfinite(payload: Buffer, dtype: str) -> int:
    """The index of the first NaN or infinity in ``payload`` (elements of ``dtype``), or
    -1: none, or ``dtype`` is not floating point. ValueError when ``payload`` is not a
    whole number of elements."""
    bits = NONFINITE_BITS.get(dtype)
    if bits is None:
        return -1
    if _finite is not None:
        found: int = _finite.first_nonfinite(payload, *bits)
        return found
    return first_nonfinite_py(payload, *bits)


def first_nonfinite_py(payload: Buffer, width: int, mask: int) -> int:
    """``first_nonfinite`` with numpy (and what the C scan is tested against)."""
    import numpy as np

    view = memoryview(payload).cast("B")
    if view.nbytes % width:
        raise ValueError(f"first_nonfinite: {view.nbytes} bytes is not a whole number of {width}-byte elements")
    items = np.frombuffer(view, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32}[width])
    for start in range(0, len(items), _NUMPY_BLOCK):
        block = items[start : start + _NUMPY_BLOCK]
        hits = np.flatnonzero((block & mask) == mask)
        if len(hits):
            return start + int(hits[0])
    return -1
