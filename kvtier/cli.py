"""The ``kvtier`` command: ``kvtier server``, ``kvtier operator``, ``kvtier bench``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

SERVER_EPILOG = """\
Every flag can also be set with the env var shown in its help (a flag wins).
Tiers: RAM always; the disk tier unless --disk-bytes 0; Redis when --redis-url
is given. Reads go RAM -> disk -> Redis and promote hits upwards; writes land
in RAM and are written behind to the other tiers (--write-policy).

Examples:
  kvtier server                                   # RAM 2GiB + disk 20GiB, port 50051
  kvtier server --ram-bytes 8GiB --disk-dir /nvme/kvtier --disk-bytes 500GiB
  KVTIER_REDIS_PASSWORD=... kvtier server --redis-url redis://redis:6379/0
  kvtier server --redis-url redis+cluster://10.0.0.5:6379   # Redis Cluster

The wire contract is docs/protocol.md; health: grpc.health.v1 on the same port.
"""


def _server(argv: Sequence[str]) -> int:
    from kvtier.cacheserver import settings as settings_mod
    from kvtier.cacheserver.errors import SettingsError, TierFailure

    parser = argparse.ArgumentParser(
        prog="kvtier server",
        description="Run the kvtier cache tier: a gRPC KV-chunk store for vLLM engines.",
        epilog=SERVER_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    settings_mod.add_arguments(parser)
    args = parser.parse_args(list(argv))
    try:
        settings = settings_mod.from_args(args)
    except SettingsError as exc:
        parser.error(str(exc))
    _logging(settings.log_level)
    from kvtier.cacheserver.server import serve

    try:
        return asyncio.run(serve(settings))
    except SettingsError as exc:
        parser.error(str(exc))
    except (TierFailure, OSError) as exc:
        print(f"kvtier server: {exc}", file=sys.stderr)
        return 1


def _operator(argv: Sequence[str]) -> int:
    try:
        from kvtier.operator.main import run  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:  # the operator extra is not installed
        print(f"kvtier operator: {exc}; install with: pip install 'kvtier[operator]'", file=sys.stderr)
        return 1
    return int(run(list(argv)))


def _bench(argv: Sequence[str]) -> int:
    """Runs bench/ of the source checkout this kvtier is installed from (editable install)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / "bench" / "cli.py").is_file():
        print(
            "kvtier bench: the benchmarks live in bench/ of a source checkout; "
            "clone kvtier, run scripts/setup, then .venv/bin/kvtier bench",
            file=sys.stderr,
        )
        return 1
    sys.path.insert(0, str(root))
    from bench.cli import main as bench_main  # type: ignore[import-not-found,unused-ignore]

    return int(bench_main(list(argv)))


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


COMMANDS = {
    "server": (_server, "run the cache tier (gRPC; RAM + disk, optional Redis)"),
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
