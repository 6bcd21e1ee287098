"""Acceptance: status.traffic from the pods' real /metrics, against the real API server.

No kubelet runs, so no pod runs either: each test serves a pod's port itself, on a
loopback address of its own (127.x.y.z, never 127.0.0.1, so the fixed pod ports 8000
and 9400 do not collide with anything else on the machine), and marks the pod Ready
with that address as its IP, as a kubelet would. The tier's page is a real ``kvtier
server``'s (Lookups through a real TierClient move its counters); an engine's page is the
kvtier connector's own series served by prometheus_client, as vLLM serves them.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import start_http_server

from kvtier.connector.client import TierClient
from kvtier.operator.children import ENGINE_PORT, METRICS_PORT
from kvtier.operator.kube import KubeClient
from kvtier.testing.redisprocs import free_port
from tests.operator.cluster import CACHE_TIER, MODEL_RECIPE, eventually, mark_pods_ready
from tests.operator.test_traffic import EnginePage

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("operator")]

TIER = "app.kubernetes.io/instance=shared,app.kubernetes.io/component=cache-tier"
ENGINES = "app.kubernetes.io/instance=qwen,app.kubernetes.io/component=engine"


def loopback_address(port: int) -> str:
    """A 127.0.0.0/8 address (not 127.0.0.1) on which ``port`` is free."""
    rng = random.Random()
    for _ in range(100):
        address = f"127.{rng.randint(64, 250)}.{rng.randint(0, 255)}.{rng.randint(2, 254)}"
        with socket.socket() as probe:
            try:
                probe.bind((address, port))
            except OSError:
                continue
            return address
    raise AssertionError(f"no loopback address with port {port} free")


@contextlib.contextmanager
def tier_pod(tmp_path: Path) -> Iterator[tuple[str, TierClient]]:
    """A real ``kvtier server`` with its metrics on <address>:9400, as a tier pod; the
    address and a client of its gRPC port."""
    address, port = loopback_address(METRICS_PORT), free_port()
    env = {**os.environ, "KVTIER_HOST": address, "KVTIER_PORT": str(port),
           "KVTIER_METRICS_PORT": str(METRICS_PORT), "KVTIER_RAM_BYTES": "64MiB",
           "KVTIER_DISK_BYTES": "0"}  # fmt: skip
    log = tmp_path / "tier.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cacheserver"], env=env, cwd=tmp_path,
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        client = TierClient(f"{address}:{port}", timeout_s=5)
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, log.read_text()
            with contextlib.suppress(Exception):
                client.lookup([b"warm-up"])
                break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        with client:
            yield address, client
    finally:
        server.terminate()
        server.wait(30)


@contextlib.contextmanager
def engine_pod(page: EnginePage) -> Iterator[str]:
    """The engine's /metrics on <address>:8000; the address."""
    address = loopback_address(ENGINE_PORT)
    server, thread = start_http_server(ENGINE_PORT, addr=address, registry=page.registry)
    try:
        yield address
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@contextlib.contextmanager
def silent_pod(port: int) -> Iterator[str]:
    """An address where ``port`` accepts connections and never answers (a hung pod)."""
    address = loopback_address(port)
    listener = socket.socket()
    listener.bind((address, port))
    listener.listen(16)
    try:
        yield address
    finally:
        listener.close()


def cache_tier(namespace: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvtier.io/v1alpha1", "kind": "CacheTier",
        "metadata": {"name": "shared", "namespace": namespace},
        "spec": {"disk": {"enabled": False}, **spec},
    }  # fmt: skip


def model_recipe(namespace: str, replicas: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "kvtier.io/v1alpha1", "kind": "ModelRecipe",
        "metadata": {"name": "qwen", "namespace": namespace},
        "spec": {
            "model": {"repo": "Qwen/Qwen2-0.5B", "architecture": "Qwen2ForCausalLM"},
            "engine": {"image": "vllm/vllm-openai:test", "gpus": 0, "replicas": replicas},
            "tier": {"ref": {"name": "shared"}},
        },
    }  # fmt: skip


async def traffic_of(
    kube: KubeClient, namespace: str, kind: str, name: str, **expected: Any
) -> dict[str, Any]:
    """Wait until the resource's status.traffic has the expected values; its status."""
    resource = {"CacheTier": CACHE_TIER, "ModelRecipe": MODEL_RECIPE}[kind]

    async def probe() -> dict[str, Any] | None:
        obj = await kube.get(resource, namespace, name)
        status = (obj or {}).get("status") or {}
        traffic = status.get("traffic") or {}
        return status if all(traffic.get(k) == v for k, v in expected.items()) else None

    return await eventually(probe, within=60, what=f"{kind} {name} traffic {expected}")


async def test_a_recipes_status_reports_hit_rate_tokens_served_and_tier_state_as_traffic_flows(
    kube: KubeClient, namespace: str, tmp_path: Path
) -> None:
    page = EnginePage()
    with tier_pod(tmp_path) as (tier_address, tier), engine_pod(page) as engine_address:
        await kube.create(cache_tier(namespace))
        await mark_pods_ready(kube, namespace, TIER, ips=[tier_address])
        status = await traffic_of(kube, namespace, "CacheTier", "shared", state="Known")
        assert status["state"] == "Serving"
        assert [layer["tier"] for layer in status["traffic"]["storage"]] == ["ram"]
        assert status["traffic"]["storage"][0]["healthy"] is True
        await kube.create(model_recipe(namespace))
        await mark_pods_ready(kube, namespace, ENGINES, ips=[engine_address])
        page.traffic(lookups=8, hits=6, tokens=1536)
        status = await traffic_of(
            kube, namespace, "ModelRecipe", "qwen",
            state="Known", chunkHitRate=0.75, tokensServed=1536, tierState="Serving",
        )  # fmt: skip
        assert status["traffic"]["enginesReporting"] == status["traffic"]["engines"] == 1
        # More traffic, newer numbers.
        page.traffic(lookups=2, hits=2, tokens=512)
        await traffic_of(
            kube, namespace, "ModelRecipe", "qwen",
            lookupChunks=10, hitChunks=8, chunkHitRate=0.8, tokensServed=2048,
        )  # fmt: skip
        # The tier's own Lookup counters: 2 of 3 keys found.
        assert tier.put([(b"k1", b"v1"), (b"k2", b"v2")]) == 2
        before = (await traffic_of(kube, namespace, "CacheTier", "shared"))["traffic"]
        tier.lookup([b"k1", b"k2", b"k3"])
        await traffic_of(
            kube, namespace, "CacheTier", "shared",
            lookupChunks=before["lookupChunks"] + 3, hitChunks=before["hitChunks"] + 2,
        )  # fmt: skip


async def test_engines_that_hang_or_stop_answering_make_traffic_partial_then_unknown(
    kube: KubeClient, namespace: str
) -> None:
    page = EnginePage()
    page.traffic(lookups=4, hits=1, tokens=256)
    await kube.create(cache_tier(namespace, metrics={"enabled": False}))
    with engine_pod(page) as answering, silent_pod(ENGINE_PORT) as hung:
        await kube.create(model_recipe(namespace, replicas=2))
        await mark_pods_ready(kube, namespace, ENGINES, ips=[answering, hung], count=2)
        status = await traffic_of(
            kube, namespace, "ModelRecipe", "qwen", state="Partial", chunkHitRate=0.25
        )
        traffic = status["traffic"]
        assert (traffic["engines"], traffic["enginesReporting"]) == (2, 1)
        assert "metrics of 1/2 engine pods unknown" in traffic["message"]
        assert "no answer within 2 s" in traffic["message"]  # the hung pod: bounded
    # Nothing answers any more: unknown, not zero, and the operator carries on.
    status = await traffic_of(kube, namespace, "ModelRecipe", "qwen", state="Unknown")
    assert "chunkHitRate" not in status["traffic"] and "tokensServed" not in status["traffic"]
    assert status["traffic"]["tierState"] == "Down"  # its pod never got ready
    tier = await traffic_of(kube, namespace, "CacheTier", "shared", state="Unknown")
    assert "metrics are off" in tier["traffic"]["message"]
    await kube.patch(MODEL_RECIPE, namespace, "qwen", {"spec": {"engine": {"replicas": 1}}})

    async def reconciled() -> bool:
        obj = await kube.get(MODEL_RECIPE, namespace, "qwen")
        return bool(obj and obj["status"].get("observedGeneration") == 2)

    await eventually(reconciled, what="the edit reconciled while metrics fail")
