"""Every Prometheus metric the cache tier exports (names ``kvtier_*``).

Request-level metrics are updated by the servicer as calls finish. Tier-level
metrics (hits, misses, bytes used, evictions, ...) are read from the tiers'
own counters at scrape time by ``TierCollector``, so there is one source of
truth and no bookkeeping on the hot path. Labels are bounded: ``op`` (the five gRPC
calls Lookup, Get, Put, Delete, Stats, and the data port's DataHello, DataGet, DataPut,
DataInvalid), ``code`` (gRPC status names), ``tier`` (ram, disk, redis).

Each server owns its registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.cacheserver.ram import RamTier
from kvtier.cacheserver.tiers import Tier

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
        yield from (hits, misses, evictions, corrupt, used, capacity, entries, healthy, pooled, reused)
