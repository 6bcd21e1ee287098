"""Builds and runs the cache tier: tiers, store, request core and its edges, health, metrics.

The tiers go into one ``TieredStore``; one ``RequestCore`` serves every edge:
the gRPC servicer (with health and reflection on the same port), with
``--data-port`` the data port, and with ``--local-socket`` the same-node transport
(whose RAM tier then keeps values in shared memfd segments, ``arena.py``).

``serve(settings)`` runs until SIGTERM/SIGINT, then shuts down gracefully:
health turns NOT_SERVING (load balancers stop sending), in-flight calls get
``--grace-period`` to finish, pending write-behind copies are flushed within
the same period, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from kvtier.cacheserver.arena import SharedArena
from kvtier.cacheserver.auth import TokenAuth
from kvtier.cacheserver.core import Authenticate, RequestCore, no_auth
from kvtier.cacheserver.dataport import DataPort
from kvtier.cacheserver.datastreams import ssl_context
from kvtier.cacheserver.disk import DiskTier
from kvtier.cacheserver.localport import LocalPort
from kvtier.cacheserver.metrics import (
    IncomingCollector,
    LocalCollector,
    ServerMetrics,
    TierCollector,
)
from kvtier.cacheserver.ram import RamTier
from kvtier.cacheserver.servicer import MAX_PUT_FRAME_BYTES, CacheServicer
from kvtier.cacheserver.settings import Settings
from kvtier.cacheserver.store import StorePolicy, TieredStore
from kvtier.cacheserver.tiers import Tier
from kvtier.proto import SERVICE_NAME, cache_pb2

logger = logging.getLogger(__name__)


@dataclass
class RunningServer:
    """A started tier; ``port``/``metrics_port`` are the bound ones (useful with port 0)."""

    settings: Settings
    server: grpc.aio.Server
    store: TieredStore
    health: HealthServicer
    metrics: ServerMetrics
    port: int
    metrics_port: int = 0
    data: DataPort | None = None
    local: LocalPort | None = None
    _http: object = field(default=None, repr=False)

    @property
    def data_port(self) -> int:
        """The bound data port (0: off)."""
        return 0 if self.data is None else self.data.port

    @property
    def target(self) -> str:
        return f"{self.settings.host}:{self.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        grace = self.settings.grace_period_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        self.metrics.healthy.set(0)
        edges = [self.server.stop(grace)]
        edges += [edge.close(grace) for edge in (self.data, self.local) if edge is not None]
        await asyncio.gather(*edges)
        if not await self.store.drain(grace):
            logger.warning("shutdown: write-behind copies still pending after %.1fs were dropped", grace)
        await self.store.close()
        if self._http is not None:
            with contextlib.suppress(Exception):
                self._http.shutdown()  # type: ignore[attr-defined]


async def build_tiers(settings: Settings) -> list[Tier]:
    quota = settings.tenant_quota_bytes
    recycle = min(settings.ram_recycle_bytes, settings.ram_bytes // 4)
    arena = None
    if settings.local_socket is not None:
        # Values, plus values being received, plus values dropped while still being read.
        arena = SharedArena(settings.ram_bytes + settings.incoming_bytes)
    tiers: list[Tier] = [
        RamTier(settings.ram_bytes, tenant_quota_bytes=quota, recycle_bytes=recycle, arena=arena)
    ]
    if settings.disk_bytes > 0 and settings.disk_dir is not None:
        disk = DiskTier(
            settings.disk_dir, settings.disk_bytes, fsync=settings.disk_fsync, tenant_quota_bytes=quota
        )
        await disk.open()
        tiers.append(disk)
    if settings.redis_url:
        from kvtier.cacheserver.redis_tier import RedisTier

        tiers.append(
            RedisTier(
                settings.redis_url,
                password=settings.redis_password,
                timeout_s=settings.redis_timeout_s,
                ttl_s=int(settings.redis_ttl_s),
                tls_ca_file=_str(settings.redis_tls_ca_file),
                tls_cert_file=_str(settings.redis_tls_cert_file),
                tls_key_file=_str(settings.redis_tls_key_file),
                tenant_quota_bytes=quota,
            )
        )
    return tiers


def _str(path: object) -> str | None:
    return None if path is None else str(path)


def grpc_options(settings: Settings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_PUT_FRAME_BYTES + (1 << 20)),
        ("grpc.max_send_message_length", settings.frame_bytes),
        ("grpc.so_reuseport", 0),
    ]


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    pair = (settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())
    if settings.tls_client_ca_file is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials(
        [pair], root_certificates=settings.tls_client_ca_file.read_bytes(), require_client_auth=True
    )


async def start(settings: Settings, *, authenticate: Authenticate | None = None) -> RunningServer:
    """Starts a tier in the running event loop and returns once it accepts calls."""
    if authenticate is None:
        authenticate = TokenAuth(settings.auth_tokens).authenticate if settings.auth_tokens else no_auth
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    tiers = await build_tiers(settings)
    policy = StorePolicy(
        write_through=settings.write_policy == "write-through",
        write_behind_bytes=settings.write_behind_bytes,
        tier_timeout_s=settings.tier_timeout_s,
    )
    store = TieredStore(tiers, policy, metrics)
    registry.register(TierCollector(lambda: store.tiers, store.is_healthy))
    store.start()

    server = grpc.aio.server(options=grpc_options(settings))
    core = RequestCore(store, settings, metrics, authenticate)
    registry.register(IncomingCollector(core.budget))
    servicer = CacheServicer(core)
    server.add_generic_rpc_handlers((servicer.handler(),))
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name,
            health.SERVICE_NAME,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    address = f"{settings.host}:{settings.port}"
    credentials = server_credentials(settings)
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        await store.close()
        raise OSError(f"cannot listen on {settings.host}:{settings.port} (in use or not an address of this host)")
    data = local = None
    try:
        if settings.data_port:
            data = DataPort(core, ssl_context(settings))
            await data.start()
        top = store.tiers[0]
        if settings.local_socket is not None and isinstance(top, RamTier) and top.arena is not None:
            local = LocalPort(core, top.arena, settings.local_socket)
            await local.start()
            registry.register(LocalCollector(local, top.arena))
    except OSError:
        if data is not None:
            await data.close(0)
        await store.close()
        raise
    await server.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    await health_servicer.set("", serving)
    await health_servicer.set(SERVICE_NAME, serving)
    metrics.healthy.set(1)

    running = RunningServer(settings, server, store, health_servicer, metrics, port, data=data, local=local)
    if settings.metrics_port:
        http, _thread = start_http_server(settings.metrics_port, addr=settings.host, registry=registry)
        running._http = http
        running.metrics_port = http.server_address[1]
    return running


async def serve(settings: Settings) -> int:
    """Runs the tier until SIGTERM or SIGINT; returns the process exit code."""
    running = await start(settings)
    tiers = ", ".join(
        f"{t.name} {t.usage().capacity_bytes / (1 << 30):.1f}GiB" if t.usage().capacity_bytes else t.name
        for t in running.store.tiers
    )
    logger.info(
        "kvtier server listening on %s (data port %s; local socket %s; tiers: %s; metrics on :%s/metrics)",
        running.target,
        running.data_port or "off",
        settings.local_socket or "off",
        tiers,
        running.metrics_port or "off",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down: NOT_SERVING, %.1fs grace for in-flight calls", settings.grace_period_s)
    await running.stop()
    logger.info("stopped")
    return 0
