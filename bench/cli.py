"""``kvtier bench``: runs one of the benchmark harnesses of bench/.

    python -m bench tier [--tiny] [...]     the tier data path (bench/tier.py)
    python -m bench keys [...]              cache keys against vLLM's (bench/keys.py)
    python -m bench ec [--tiny] [...]       the encoder-output cache (bench/ec.py)
    python -m bench e2e [--tiny] [...]      TTFT on real vLLM, no cache / vLLM offload / kvtier (bench/e2e.py)

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
        from bench import tier

        return tier.main(rest)
    if name == "e2e":
        from bench import e2e

        return e2e.main(rest)
    if name == "ec":
        from bench import ec

        return ec.main(rest)
    from bench import keys

    # bench.keys reads sys.argv itself.
    saved = sys.argv
    sys.argv = [f"kvtier bench {name}", *rest]
    try:
        keys.main()
    finally:
        sys.argv = saved
    return 0
