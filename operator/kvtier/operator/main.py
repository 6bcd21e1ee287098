"""``kvtier operator``: run the kopf operator that reconciles ModelRecipes and CacheTiers."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Sequence

import kopf

from kvtier.operator.handlers import OperatorConfig, register

DEFAULT_TIER_IMAGE = "ghcr.io/kvtier/kvtier-server:0.1.0"
DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


def build_parser(prog: str = "kvtier operator") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Reconcile kvtier.io ModelRecipes and CacheTiers (a kopf operator). "
        "Credentials: the pod's service account, else $KUBECONFIG or ~/.kube/config.",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], metavar="NS",
        help="watch this namespace (repeatable; globs such as 'team-*' work); default: all",
    )  # fmt: skip
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)"
    )
    parser.add_argument(
        "--tier-image", default=DEFAULT_TIER_IMAGE, metavar="IMAGE",
        help=f"image of CacheTiers that set no spec.image (default {DEFAULT_TIER_IMAGE})",
    )  # fmt: skip
    parser.add_argument(
        "--resync-seconds", type=float, default=30.0, metavar="S",
        help="re-apply every resource this often: restores deleted or edited children, "
        "picks up readiness (default 30)",
    )  # fmt: skip
    parser.add_argument(
        "--traffic-seconds", type=float, default=30.0, metavar="S",
        help="read the ready pods' /metrics this often into status.traffic (chunk hit rate, "
        "tokens served, the tier's state); 0 turns it off (default 30)",
    )  # fmt: skip
    parser.add_argument(
        "--liveness", default=DEFAULT_LIVENESS, metavar="URL",
        help=f"serve kopf's liveness probe here; '' turns it off (default {DEFAULT_LIVENESS})",
    )  # fmt: skip
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def identity() -> str:
    """Who this operator is, for kopf: the pod (``POD_ID``) or the host name.

    Given to kopf explicitly: kopf's own guess asks the passwd database for the user
    (``getpass.getuser``), which fails in an image run as a numeric user with no entry
    (any uid a cluster picks)."""
    return os.environ.get("POD_ID") or f"kvtier-operator@{socket.gethostname()}"


def run(argv: Sequence[str], prog: str = "kvtier operator") -> int:
    """Run the operator until SIGINT/SIGTERM; the exit status."""
    parser = build_parser(prog)
    args = parser.parse_args(list(argv))
    if args.resync_seconds <= 0:
        parser.error("--resync-seconds must be positive")
    if args.traffic_seconds < 0:
        parser.error("--traffic-seconds must be 0 (off) or positive")
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    registry = kopf.OperatorRegistry()
    register(registry, OperatorConfig(
        tier_image=args.tier_image, resync_seconds=args.resync_seconds,
        traffic_seconds=args.traffic_seconds,
    ))  # fmt: skip
    logging.getLogger(__name__).info(
        "watching %s", ", ".join(args.namespace) if args.namespace else "all namespaces"
    )
    kopf.run(
        registry=registry,
        standalone=True,  # no peering: run one replica
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
        # kopf's Identity is a NewType of str that kopf does not export.
        identity=identity(),  # type: ignore[arg-type]
    )
    return 0


def main() -> int:
    """The ``kvtier-operator`` console script (the operator image's command)."""
    return run(sys.argv[1:], prog="kvtier-operator")
