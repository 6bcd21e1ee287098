"""What the connector's NaN and infinity checks cost per chunk (docs/connector.md, "NaN and
infinities").

    python -m kvtier.bench.finite [--repeat 20]

For bfloat16 chunks of 128 KiB (the test suite's 2-layer model, 256 tokens), 3 MiB (a
0.5B model) and 16 MiB (about a 7B model), prints the best of ``--repeat`` passes:

- the scan alone (``chunks.finite.first_nonfinite``): the C helper (on the payload, and on
  a copy of it at an odd address, where a chunk whose header has an odd length puts it)
  and numpy;
- xxh3-64 of the payload, which every save and every load already computes;
- a save's ``encode_chunk`` (``raw``: a header and the xxh3-64 of the payload) without
  and with ``check_finite``;
- a load's ``decode_chunk`` (which verifies the checksum) without and with the scan of the
  decoded payload that ``KvtierWorker`` runs.

Each as GB/s and microseconds per chunk. The payload is in memory touched just before,
as a save's host buffer and a load's receive buffer are.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import numpy as np
import xxhash

from kvtier.bench.copies import best_seconds
from kvtier.connector.chunks import finite
from kvtier.connector.chunks.codec import decode_chunk, encode_chunk

SIZES = (128 << 10, 3 << 20, 16 << 20)
KEY = b"kvtier-bench-finite".ljust(32, b".")


def cases(size: int) -> list[tuple[str, Callable[[], object]]]:
    """The timed calls on one ``size``-byte bfloat16 chunk."""
    values = np.random.default_rng(size).standard_normal(size // 2, dtype=np.float32)
    payload = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    shape = (size // 2,)
    blob = b"".join(bytes(p) for p in encode_chunk(KEY, payload, dtype="bfloat16", shape=shape))
    width, mask = finite.NONFINITE_BITS["bfloat16"]
    encode = partial(encode_chunk, KEY, payload, dtype="bfloat16", shape=shape)

    def decode_and_scan() -> int:
        return finite.first_nonfinite(decode_chunk(KEY, blob).payload, "bfloat16")

    skewed = memoryview(bytearray(1) + payload.tobytes())[1:]  # a payload after an odd-length header
    return [
        ("scan (C)", partial(finite.first_nonfinite, payload, "bfloat16")),
        ("scan (C), at an odd address", partial(finite.first_nonfinite, skewed, "bfloat16")),
        ("scan (numpy)", partial(finite.first_nonfinite_py, payload, width, mask)),
        ("xxh3-64", partial(xxhash.xxh3_64_intdigest, payload)),
        ("encode_chunk raw", encode),
        ("encode_chunk raw, check_finite", partial(encode, check_finite=True)),
        ("decode_chunk", partial(decode_chunk, KEY, blob)),
        ("decode_chunk, then the scan", decode_and_scan),
    ]


def rows(repeat: int) -> list[tuple[int, str, float]]:
    """(chunk bytes, what, seconds per chunk)."""
    return [(size, name, best_seconds(fn, repeat)) for size in SIZES for name, fn in cases(size)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.finite", description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=20, help="timed passes per case (the best is printed)")
    args = p.parse_args(argv)
    print(f"C scan built: {finite._finite is not None}")
    print("| chunk | what | GB/s | us per chunk |")
    print("|---|---|---:|---:|")
    for size, name, seconds in rows(args.repeat):
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"| {label} | {name} | {size / seconds / 1e9:.1f} | {seconds * 1e6:.0f} |")


if __name__ == "__main__":
    main()
