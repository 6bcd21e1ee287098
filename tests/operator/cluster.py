"""Helpers for tests against the real API server: waiting, and playing the kubelet."""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kvtier.operator.kube import KubeClient, kind_of

T = TypeVar("T")
POD = kind_of("v1", "Pod")
EVENT = kind_of("v1", "Event")
DEPLOYMENT = kind_of("apps/v1", "Deployment")
STATEFULSET = kind_of("apps/v1", "StatefulSet")
DAEMONSET = kind_of("apps/v1", "DaemonSet")
SERVICE = kind_of("v1", "Service")
CONFIGMAP = kind_of("v1", "ConfigMap")
SECRET = kind_of("v1", "Secret")
CLAIM = kind_of("v1", "PersistentVolumeClaim")
CACHE_TIER = kind_of("kvtier.io/v1alpha1", "CacheTier")
MODEL_RECIPE = kind_of("kvtier.io/v1alpha1", "ModelRecipe")


async def eventually(
    probe: Callable[[], Awaitable[T | None]], *, within: float = 30, what: str = "a condition"
) -> T:
    """Poll ``probe`` until it returns something truthy; its value."""
    deadline = time.monotonic() + within
    last: T | None = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {within} s waiting for {what}; last value: {last!r}")


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    """The status condition ``type_`` of ``obj`` ({} when absent)."""
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


async def wait_for_condition(
    kube: KubeClient,
    namespace: str,
    kind: str,
    name: str,
    type_: str,
    *,
    status: str | None = None,
    reason: str | None = None,
    generation: int | None = None,
) -> dict[str, Any]:
    """Wait until the custom resource's condition has this status/reason; the object."""
    resource = {"CacheTier": CACHE_TIER, "ModelRecipe": MODEL_RECIPE}[kind]

    async def probe() -> dict[str, Any] | None:
        obj = await kube.get(resource, namespace, name)
        found = condition(obj, type_)
        if obj is None or not found:
            return None
        if status is not None and found["status"] != status:
            return None
        if reason is not None and found.get("reason") != reason:
            return None
        if generation is not None and obj["status"].get("observedGeneration") != generation:
            return None
        return obj

    return await eventually(probe, what=f"{kind} {name} {type_}={status} ({reason})")


async def mark_pods_ready(
    kube: KubeClient, namespace: str, selector: str, ips: list[str] | None = None, count: int = 1
) -> int:
    """Set every selected pod Running and Ready, as a kubelet would, once there are at least
    ``count``; how many there were. ``ips``: the pods' IPs, in the order of their names
    (local addresses where a test serves what the pod would)."""

    async def listed() -> list[dict[str, Any]] | None:
        pods = await kube.list(POD, namespace, selector)
        return pods if len(pods) >= count else None

    pods = await eventually(listed, what=f"{count} pods with {selector}")
    pods.sort(key=lambda pod: pod["metadata"]["name"])
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for i, pod in enumerate(pods):
        containers = [c["name"] for c in pod["spec"]["containers"]]
        addresses: dict[str, Any] = {}
        if ips is not None:
            addresses = {"podIP": ips[i], "podIPs": [{"ip": ips[i]}]}
        await kube.patch(POD, namespace, pod["metadata"]["name"], {"status": {
            **addresses,
            "phase": "Running",
            "startTime": now,
            "conditions": [
                {"type": type_, "status": "True", "lastTransitionTime": now}
                for type_ in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
            ],
            "containerStatuses": [
                {"name": name, "ready": True, "started": True, "restartCount": 0,
                 "image": "test", "imageID": "", "state": {"running": {"startedAt": now}}}
                for name in containers
            ],
        }}, sub="status")  # fmt: skip
    return len(pods)
