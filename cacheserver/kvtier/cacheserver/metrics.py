"""Every Prometheus metric the cache tier exports (names ``kvtier_*``).

Request-level metrics are updated by the request core (``kvtier.cacheserver.core``) as
calls finish, whichever edge carried them. Tier-level
metrics (hits, misses, bytes used, evictions, ...) are read from the tiers'
own counters at scrape time by ``TierCollector``, so there is one source of
truth and no bookkeeping on the hot path. Labels are bounded: ``op`` (the five gRPC
calls Lookup, Get, Put, Delete, Stats, the data port's DataHello, DataGet, DataPut,
DataInvalid, and the same-node transport's LocalHello, LocalLookup, LocalGet, LocalPut,
LocalDelete, LocalStats, LocalStage, LocalInvalid), ``code`` (gRPC status names),
``tier`` (ram, disk, redis).

Each server owns its registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.cacheserver.budget import ReceiveBudget
from kvtier.cacheserver.ram import RamTier
from kvtier.cacheserver.tiers import Tier

if TYPE_CHECKING:
    from kvtier.cacheserver.arena import SharedArena
    from kvtier.cacheserver.localport import LocalPort

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "kvtier_server_requests",
            "Calls answered, by operation and gRPC status code.",
            ["op", "code"],
            registry=registry,
        )
        self.latency = Histogram(
            "kvtier_server_request_duration_seconds",
            "Time to answer a call, by operation.",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.received_bytes = Counter(
            "kvtier_server_received_bytes", "Value bytes received by Put.", registry=registry
        )
        self.sent_bytes = Counter(
            "kvtier_server_sent_bytes", "Value bytes sent by Get.", registry=registry
        )
        self.lookup_keys = Counter(
            "kvtier_server_lookup_keys",
            "Keys asked about by Lookup (the denominator of the chunk hit rate).",
            registry=registry,
        )
        self.lookup_hit_keys = Counter(
            "kvtier_server_lookup_hit_keys",
            "Keys Lookup reported present (leading prefix).",
            registry=registry,
        )
        self.get_keys = Counter(
            "kvtier_server_get_keys", "Keys asked for by Get.", ["result"], registry=registry
        )
        self.tier_errors = Counter(
            "kvtier_tier_errors",
            "Failed operations of a storage tier (the store fell back to the other tiers).",
            ["tier", "op"],
            registry=registry,
        )
        self.promotions = Counter(
            "kvtier_tier_promotions",
            "Values copied up into a tier after a hit in a lower tier.",
            ["tier"],
            registry=registry,
        )
        self.write_behind_dropped = Counter(
            "kvtier_write_behind_dropped",
            "Write-behind copies to a lower tier dropped because the queue was full.",
            ["tier"],
            registry=registry,
        )
        self.pending_deletes = Gauge(
            "kvtier_tier_pending_deletes",
            "Deleted keys a failing tier has not seen yet, replayed when it recovers.",
            ["tier"],
            registry=registry,
        )
        self.deletes_dropped = Counter(
            "kvtier_tier_deletes_dropped",
            "Deletes a failing tier missed and that will not be replayed (too many were waiting).",
            ["tier"],
            registry=registry,
        )
        self.write_behind_depth = Gauge(
            "kvtier_write_behind_queue_depth",
            "Values waiting to be written behind to the lower tiers.",
            registry=registry,
        )
        self.data_connections = Gauge(
            "kvtier_server_data_connections",
            "Data-port connections open now.",
            registry=registry,
        )
        self.data_connections_refused = Counter(
            "kvtier_server_data_connections_refused",
            "Data-port connections closed at once because --data-max-connections were open.",
            registry=registry,
        )
        self.healthy = Gauge(
            "kvtier_server_serving",
            "1 while the server answers calls, 0 while it drains at shutdown.",
            registry=registry,
        )


class TierCollector(Collector):
    """Reads each tier's counters and usage at scrape time."""

    def __init__(self, tiers: Callable[[], Sequence[Tier]], healthy: Callable[[str], bool]) -> None:
        self._tiers = tiers
        self._healthy = healthy

    def collect(self) -> Iterable[Metric]:
        hits = CounterMetricFamily("kvtier_tier_hits", "Values found in a tier.", labels=["tier"])
        misses = CounterMetricFamily(
            "kvtier_tier_misses", "Values looked for and not found in a tier.", labels=["tier"]
        )
        evictions = CounterMetricFamily(
            "kvtier_tier_evictions", "Values evicted to make room.", labels=["tier"]
        )
        corrupt = CounterMetricFamily(
            "kvtier_tier_verification_failures",
            "Stored records that failed verification (deleted, served as a miss).",
            labels=["tier"],
        )
        used = GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes stored in a tier.", labels=["tier"])
        capacity = GaugeMetricFamily(
            "kvtier_tier_capacity_bytes", "Configured capacity of a tier (0: unknown).", labels=["tier"]
        )
        entries = GaugeMetricFamily("kvtier_tier_entries", "Values stored in a tier.", labels=["tier"])
        healthy = GaugeMetricFamily(
            "kvtier_tier_healthy", "1 when the tier answers, 0 while it is failing.", labels=["tier"]
        )
        pooled = GaugeMetricFamily(
            "kvtier_ram_recycled_bytes",
            "Bytes of dropped values' buffers the RAM tier keeps for new values (within its capacity).",
        )
        reused = CounterMetricFamily(
            "kvtier_ram_recycled_buffers_reused",
            "Values received into a recycled buffer instead of fresh memory.",
        )
        tenant_used = GaugeMetricFamily(
            "kvtier_tenant_used_bytes",
            "Bytes one tenant holds in a tier (Redis: with --tenant-quota-bytes only).",
            labels=["tier", "tenant"],
        )
        tenant_entries = GaugeMetricFamily(
            "kvtier_tenant_entries",
            "Values one tenant holds in a tier (Redis: with --tenant-quota-bytes only).",
            labels=["tier", "tenant"],
        )
        tenant_evictions = CounterMetricFamily(
            "kvtier_tenant_evictions",
            "One tenant's values evicted from a tier (Redis: by its quota; Redis's own "
            "maxmemory evictions are in kvtier_tier_evictions_total only).",
            labels=["tier", "tenant"],
        )
        for tier in self._tiers():
            if isinstance(tier, RamTier):
                pooled.add_metric([], tier.pool.bytes)
                reused.add_metric([], tier.pool.reused)
            c, u = tier.counters, tier.usage()
            hits.add_metric([tier.name], c.hits)
            misses.add_metric([tier.name], c.misses)
            evictions.add_metric([tier.name], c.evictions)
            corrupt.add_metric([tier.name], c.verification_failures)
            used.add_metric([tier.name], u.used_bytes)
            capacity.add_metric([tier.name], u.capacity_bytes)
            entries.add_metric([tier.name], u.entries)
            healthy.add_metric([tier.name], 1.0 if self._healthy(tier.name) else 0.0)
            for tenant, usage in tier.tenant_usages().items():
                tenant_used.add_metric([tier.name, tenant], usage.used_bytes)
                tenant_entries.add_metric([tier.name, tenant], usage.entries)
            for tenant, counts in c.tenants.items():
                tenant_evictions.add_metric([tier.name, tenant], counts.evictions)
        yield from (hits, misses, evictions, corrupt, used, capacity, entries, healthy, pooled, reused)
        yield from (tenant_used, tenant_entries, tenant_evictions)


class IncomingCollector(Collector):
    """Reads the budget of memory for incoming values (``--incoming-bytes``) at scrape time."""

    def __init__(self, budget: ReceiveBudget) -> None:
        self._budget = budget

    def collect(self) -> Iterable[Metric]:
        used = GaugeMetricFamily(
            "kvtier_server_incoming_bytes",
            "Bytes reserved now for values (and data-port tables) being received.",
        )
        limit = GaugeMetricFamily(
            "kvtier_server_incoming_limit_bytes", "The budget of those bytes (--incoming-bytes)."
        )
        refused = CounterMetricFamily(
            "kvtier_server_incoming_refused",
            "Puts (or data-port tables) refused because the budget was spent (answered UNAVAILABLE).",
        )
        used.add_metric([], self._budget.used)
        limit.add_metric([], self._budget.limit_bytes)
        refused.add_metric([], self._budget.refused)
        yield from (used, limit, refused)


class LocalCollector(Collector):
    """Reads the same-node transport and the RAM tier's shared segments at scrape time."""

    def __init__(self, port: LocalPort, arena: SharedArena) -> None:
        self._port = port
        self._arena = arena

    def collect(self) -> Iterable[Metric]:  # runs in the HTTP server's thread: reads only
        connections = GaugeMetricFamily(
            "kvtier_local_connections", "Open connections on the same-node socket (--local-socket)."
        )
        leased = GaugeMetricFamily(
            "kvtier_local_leased_bytes",
            "Bytes of values same-node clients are copying out now (leased: not reused until released).",
        )
        timeouts = CounterMetricFamily(
            "kvtier_local_lease_timeouts",
            "Same-node connections closed because they held a lease longer than --data-timeout.",
        )
        shared = GaugeMetricFamily(
            "kvtier_ram_shared_bytes", "Bytes of the memfd segments the RAM tier keeps values in."
        )
        shared_used = GaugeMetricFamily(
            "kvtier_ram_shared_used_bytes",
            "Bytes of those segments in use: values, values being received, values still being read.",
        )
        connections.add_metric([], self._port.connections)
        leased.add_metric([], self._port.leased_bytes)
        timeouts.add_metric([], self._port.lease_timeouts)
        shared.add_metric([], self._arena.total_bytes)
        shared_used.add_metric([], self._arena.live_bytes())
        yield from (connections, leased, timeouts, shared, shared_used)
