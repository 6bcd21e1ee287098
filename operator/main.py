"""``kvtier operator``: run the kopf operator that reconciles ModelRecipes and CacheTiers."""

from __future__ import annotations

import argparse
import logging

import kopf

from kvtier.operator.handlers import OperatorConfig, register

DEFAULT_TIER_IMAGE = "ghcr.io/kvtier/kvtier:0.1.0"
DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier operator",
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
        "--liveness", default=DEFAULT_LIVENESS, metavar="URL",
        help=f"serve kopf's liveness probe here; '' turns it off (default {DEFAULT_LIVENESS})",
    )  # fmt: skip
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def run(argv: list[str]) -> int:
    """Run the operator until SIGINT/SIGTERM; the exit status."""
    args = build_parser().parse_args(argv)
    if args.resync_seconds <= 0:
        build_parser().error("--resync-seconds must be positive")
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    registry = kopf.OperatorRegistry()
    register(
        registry, OperatorConfig(tier_image=args.tier_image, resync_seconds=args.resync_seconds)
    )
    logging.getLogger(__name__).info(
        "watching %s", ", ".join(args.namespace) if args.namespace else "all namespaces"
    )
    kopf.run(
        registry=registry,
        standalone=True,  # no peering: run one replica
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
    )
    return 0
