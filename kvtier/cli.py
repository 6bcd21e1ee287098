"""The ``kvtier`` command of a full install: ``kvtier server``, ``kvtier operator``, ``kvtier bench``.

Each command is its distribution's own entry point (``kvtier-server``,
``kvtier-operator``); this dispatcher is what ``pip install kvtier`` (every part)
adds on top.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def _server(argv: Sequence[str]) -> int:
    from kvtier.cacheserver.cli import main

    return main(argv, prog="kvtier server")


def _operator(argv: Sequence[str]) -> int:
    try:
        from kvtier.operator.main import run
    except ImportError as exc:  # kvtier-operator (kopf) is not installed
        print(f"kvtier operator: {exc}; install with: pip install kvtier-operator", file=sys.stderr)
        return 1
    return run(argv)


def _bench(argv: Sequence[str]) -> int:
    from kvtier.bench.cli import main

    return main(list(argv))


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "server": (_server, "run the cache tier (gRPC + data port; RAM + disk, optional Redis)"),
    "operator": (_operator, "run the Kubernetes operator (ModelRecipe, CacheTier)"),
    "bench": (_bench, "run the benchmarks (tier data path, end to end, keys)"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = ["usage: kvtier COMMAND [--help] [ARGS]", "", "commands:"]
        lines += [f"  {name:<10}{help_}" for name, (_, help_) in COMMANDS.items()]
        text = "\n".join(lines)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"kvtier: unknown command {argv[0]!r}\n\n{text}", file=sys.stderr)
            return 2
        print(text)
        return 0
    fn, _ = COMMANDS[argv[0]]
    return fn(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
