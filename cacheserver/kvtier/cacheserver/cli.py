"""``kvtier-server`` (also ``kvtier server`` and ``python -m kvtier.cacheserver``): run the tier."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from kvtier.cacheserver import settings as settings_mod
from kvtier.cacheserver.errors import SettingsError, TierFailure

EPILOG = """\
Every flag can also be set with the env var shown in its help (a flag wins).
Tiers: RAM always; the disk tier unless --disk-bytes 0; Redis when --redis-url
is given. Reads go RAM -> disk -> Redis and promote hits upwards; writes land
in RAM and are written behind to the other tiers (--write-policy).

Examples:
  kvtier server                                   # RAM 2GiB + disk 20GiB, port 50051
  kvtier server --ram-bytes 8GiB --disk-dir /nvme/kvtier --disk-bytes 500GiB
  KVTIER_REDIS_PASSWORD=... kvtier server --redis-url redis://redis:6379/0
  kvtier server --redis-url redis+cluster://10.0.0.5:6379   # Redis Cluster

(`kvtier-server` is the same command where only the kvtier-server distribution
is installed, as in the tier image.) The wire contract is docs/protocol.md;
health: grpc.health.v1 on the same port.
"""


def build_parser(prog: str = "kvtier server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run the kvtier cache tier: a KV-chunk store for vLLM engines "
        "(gRPC and a raw-bytes data port).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    settings_mod.add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "kvtier-server") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        settings = settings_mod.from_args(args)
    except SettingsError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=getattr(logging, settings.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from kvtier.cacheserver.server import serve

    try:
        return asyncio.run(serve(settings))
    except SettingsError as exc:
        parser.error(str(exc))
    except (TierFailure, OSError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
