"""``kvtier bench``: runs one of the benchmark harnesses of bench/.

    kvtier bench tier [--tiny] [...]     the tier data path (kvtier/bench/tier.py)
    kvtier bench keys [...]              cache keys against vLLM's (kvtier/bench/keys.py)
    kvtier bench ec [--tiny] [...]       the encoder-output cache (kvtier/bench/ec.py)
    kvtier bench e2e [--tiny] [...]      TTFT on real vLLM, no cache / vLLM offload / kvtier (kvtier/bench/e2e.py)
    kvtier bench hybrid [...]            KV memory with vLLM's hybrid KV cache manager on/off (kvtier/bench/hybrid.py)
    kvtier bench gpu [--device cuda] [...]  the KV copies on a GPU: bytes, copy rates, overlap (kvtier/bench/gpu.py)
    kvtier bench scale [--tiny] [...]    how cost grows: keys, clients, a working set 10x RAM (kvtier/bench/scale.py)
    kvtier bench probes [--rounds N]     tenant B probing tenant A's chunks, gRPC and data port (kvtier/bench/probes.py)
    kvtier bench codec [--no-engine] [...]  the zstd chunk codec: ratio and MB/s per level (kvtier/bench/codec.py)
    kvtier bench alloc [--mib N]         a large value received into fresh or kept memory (kvtier/bench/alloc.py)
    kvtier bench replace [--mib N]       a file replaced: renamed over, names swapped, truncated (kvtier/bench/replace.py)

Each harness prints a Markdown table; docs/benchmarks.md has the results and the
exact commands that made them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

HARNESSES = {
    "tier": "the tier data path: GET/PUT through kvtier, raw TCP, redis-py, LMCache",
    "keys": "cache keys: kvtier's chunk keys against vLLM's block hashes",
    "ec": "the encoder-output cache: TTFT and encoder time on an image-heavy workload",
    "e2e": "end to end: TTFT on real vLLM, no cache / vLLM's CPU offloading / kvtier",
    "hybrid": "a hybrid-attention model's KV memory, vLLM's hybrid KV cache manager on/off",
    "gpu": "the connector's KV copies on a GPU: bytes through a tier, copy rates, overlap",
    "scale": "how cost grows: metadata and latency per key count, 1-32 clients, a working set 10x RAM",
    "probes": "tenant probes: hits, answer shapes and latencies of cross-tenant probes",
    "codec": "the zstd chunk codec: ratio and MB/s per level on real KV chunks and random bf16",
    "alloc": "receive buffers: a large value filled into fresh or kept memory",
    "replace": "disk records: a file replaced by a rename over it, a swap of names, a rewrite",
}


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in HARNESSES:
        text = "usage: kvtier bench HARNESS [--help] [ARGS]\n\nharnesses:\n" + "\n".join(
            f"  {name:<8}{help_}" for name, help_ in HARNESSES.items()
        )
        if argv and argv[0] not in ("-h", "--help"):
            print(f"kvtier bench: unknown harness {argv[0]!r}\n\n{text}", file=sys.stderr)
            return 2
        print(text)
        return 0
    name, rest = argv[0], argv[1:]
    if name == "tier":
        from kvtier.bench import tier

        return tier.main(rest)
    if name == "e2e":
        from kvtier.bench import e2e

        return e2e.main(rest)
    if name == "gpu":
        from kvtier.bench import gpu

        return gpu.main(rest)
    if name == "ec":
        from kvtier.bench import ec

        return ec.main(rest)
    if name == "hybrid":
        from kvtier.bench import hybrid

        return hybrid.main(rest)
    if name == "scale":
        from kvtier.bench import scale

        return scale.main(rest)
    if name == "alloc":
        from kvtier.bench import alloc

        return alloc.main(rest)
    if name == "replace":
        from kvtier.bench import replace

        return replace.main(rest)
    if name == "codec":
        from kvtier.bench import codec

        return codec.main(rest)
    if name == "probes":
        from kvtier.bench import probes

        return probes.main(rest)
    from kvtier.bench import keys

    # bench.keys reads sys.argv itself.
    saved = sys.argv
    sys.argv = [f"kvtier bench {name}", *rest]
    try:
        keys.main()
    finally:
        sys.argv = saved
    return 0
