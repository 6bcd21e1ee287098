"""The kopf handlers: thin wrappers that run a reconcile and write its status.

For each kind, create, update, resume and a timer (``resync_seconds``) share
one idempotent path (``kvtier.operator.reconcile``); the timer is what brings
back a deleted or edited child and notices children becoming ready; it skips
a generation the change handlers have not finished. Timers get a live view of the
object: each reconcile works on a copy, and a status computed for a generation that
an edit replaced meanwhile is dropped (``status_update``). There is no delete
handler: children carry owner references and Kubernetes' garbage collector removes
them with their parent. kopf's timers still put its finalizer (``kvtier.io/finalizer``)
on every watched object, removed when the object is deleted while the operator runs
(docs/operator.md, "How it reconciles"; the chart's pre-delete hook).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvtier.operator.children import ClusterFeatures
from kvtier.operator.errors import KubeError
from kvtier.operator.kube import KubeClient
from kvtier.operator.reconcile import Context, reconcile_cache_tier, reconcile_model_recipe
from kvtier.operator.scrape import MetricsReader
from kvtier.operator.spec import GROUP, VERSION
from kvtier.operator.traffic import recipe_traffic, tier_traffic

logger = logging.getLogger(__name__)

GRPC_PROBES_SINCE = (1, 24)
# Ready reasons that need the user to act: worth a warning event when they appear.
USER_PROBLEMS = frozenset(
    {
        "InvalidSpec", "ChildConflict", "TierNotFound", "SecretNotFound", "SecretKeyNotFound",
        "ClientCertificateRequired", "VolumeNotFound",
    }
)  # fmt: skip
Reconcile = Callable[[Context, Mapping[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class OperatorConfig:
    tier_image: str
    resync_seconds: float = 30.0
    retry_seconds: float = 10.0
    traffic_seconds: float = 30.0  # read pods' /metrics into status.traffic; 0: off


@dataclass
class _Runtime:
    """What the startup handler builds for the others."""

    context: Context | None = field(default=None)


def login(**kwargs: Any) -> kopf.ConnectionInfo:
    """In a pod: its service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is None:
        raise kopf.LoginError("no credentials: not in a pod, and no $KUBECONFIG or ~/.kube/config")
    return info


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register every handler of the operator into ``registry``."""
    runtime = _Runtime()

    @kopf.on.login(registry=registry)
    def _login(**kwargs: Any) -> kopf.ConnectionInfo:
        return login(**kwargs)

    @kopf.on.startup(registry=registry)
    async def _startup(settings: kopf.OperatorSettings, **kwargs: Any) -> None:
        configure(settings)
        client = KubeClient.from_connection_info(login(settings=settings, **kwargs))
        version = await client.version()
        features = ClusterFeatures(grpc_probes=version >= GRPC_PROBES_SINCE)
        logger.info("API server %d.%d: %s", *version, features)
        metrics = MetricsReader() if config.traffic_seconds > 0 else None
        runtime.context = Context(client, config.tier_image, features, metrics)

    @kopf.on.cleanup(registry=registry)
    async def _cleanup(**_: Any) -> None:
        if runtime.context is not None:
            await runtime.context.client.close()
            if runtime.context.metrics is not None:
                await runtime.context.metrics.close()

    def handler(reconcile: Reconcile) -> Callable[..., Awaitable[None]]:
        async def handle(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
            assert runtime.context is not None, "the startup handler runs first"
            # kopf hands timers a live view of the object, which an edit changes under a
            # running reconcile: reconcile one consistent copy of it.
            snapshot = copy.deepcopy(dict(body))
            try:
                status = await reconcile(runtime.context, snapshot)
            except KubeError as exc:
                raise kopf.TemporaryError(str(exc), delay=config.retry_seconds) from exc
            update = status_update(body, snapshot, status)
            if update is not None:
                patch.status.update(update)
            previous = snapshot.get("status") or {}
            problem = new_problem(previous, status) if update is not None else None
            if problem is not None:  # a warning log and Kubernetes event, once
                logger.warning("%s: %s", *problem)
                kopf.warn(body, reason=problem[0], message=problem[1])

        return handle

    def resync(handle: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        async def maintain(body: kopf.Body, **kwargs: Any) -> None:
            # A new generation is the change handlers' job: running now would race them.
            observed = (body.get("status") or {}).get("observedGeneration")
            if observed == body.get("metadata", {}).get("generation"):
                await handle(body=body, **kwargs)

        return maintain

    def traffic(read: Reconcile) -> Callable[..., Awaitable[None]]:
        async def observe(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
            assert runtime.context is not None, "the startup handler runs first"
            snapshot = copy.deepcopy(dict(body))
            try:
                status = await read(runtime.context, snapshot)
            except KubeError as exc:  # listing pods failed: the next period tries again
                logger.warning("reading traffic of %s: %s", _identity(snapshot), exc)
                return
            if not same_status(snapshot.get("status") or {}, status):
                patch.status.update(status)

        return observe

    for plural, reconcile, read in (
        ("cachetiers", reconcile_cache_tier, tier_traffic),
        ("modelrecipes", reconcile_model_recipe, recipe_traffic),
    ):
        if config.traffic_seconds > 0:
            kopf.timer(
                GROUP, VERSION, plural, registry=registry, id="traffic",
                interval=config.traffic_seconds,
            )(traffic(read))  # fmt: skip
        handle = handler(reconcile)
        resource = (GROUP, VERSION, plural)
        kopf.on.resume(*resource, registry=registry, id="reconcile")(handle)
        kopf.on.create(*resource, registry=registry, id="reconcile")(handle)
        kopf.on.update(*resource, registry=registry, id="reconcile")(handle)
        kopf.timer(
            *resource, registry=registry, id="resync",
            interval=config.resync_seconds, initial_delay=config.resync_seconds,
        )(resync(handle))  # fmt: skip


def status_update(
    live: Mapping[str, Any], snapshot: Mapping[str, Any], status: dict[str, Any]
) -> dict[str, Any] | None:
    """The status to write after reconciling ``snapshot``, or None: when nothing changed, or
    when the object was edited meanwhile (``live`` has a newer generation: its change
    handler writes the status of what is now desired; a stale write would claim the new
    generation was observed, or hide it from the resync timer)."""
    if _generation(live) != _generation(snapshot):
        return None
    previous = snapshot.get("status") or {}
    if all(previous.get(key) == value for key, value in status.items()):
        return None
    return status


def same_status(previous: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Whether writing ``status`` (a merge patch, where None deletes) would change nothing."""
    return all(_pruned(previous.get(key)) == _pruned(value) for key, value in status.items())


def _pruned(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def _identity(body: Mapping[str, Any]) -> str:
    meta = body.get("metadata") or {}
    return f"{body.get('kind')} {meta.get('namespace')}/{meta.get('name')}"


def _generation(body: Mapping[str, Any]) -> object:
    return (body.get("metadata") or {}).get("generation")


def new_problem(previous: Mapping[str, Any], status: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) when ``Ready`` just turned to a problem the user must fix, else None."""
    before, after = _ready(previous), _ready(status)
    reason, message = str(after.get("reason", "")), str(after.get("message", ""))
    changed = (before.get("reason"), before.get("message")) != (reason, message)
    return (reason, message) if reason in USER_PROBLEMS and changed else None


def _ready(status: Mapping[str, Any]) -> Mapping[str, Any]:
    conditions = status.get("conditions") or []
    return next((c for c in conditions if c.get("type") == "Ready"), {})


def configure(settings: kopf.OperatorSettings) -> None:
    """kopf's bookkeeping in the kvtier.io annotation namespace, and no finalizers of its own."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.level = logging.WARNING  # Kubernetes events for warnings and errors only
    settings.watching.server_timeout = 300
