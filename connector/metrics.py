"""The connector's metrics, reported through vLLM's connector-stats hooks.

Both halves of the connector record into a ``Recorder``; vLLM collects
``Recorder.take()`` every engine step (``get_kv_connector_stats``), ships it from the
worker and the scheduler to the front-end process, and hands it to
``KvtierPromMetrics.observe``, which updates Prometheus series served on vLLM's own
``/metrics`` (the API server's port). vLLM adds its ``model_name``/``engine`` labels.

Series (counters get ``_total``)::

    kvtier_connector_lookups_total                    Lookup round trips
    kvtier_connector_requested_tokens_total           prompt tokens asked about
    kvtier_connector_hit_tokens_total                 tokens the tier could serve
    kvtier_connector_loaded_chunks_total / _loaded_bytes_total
    kvtier_connector_saved_chunks_total / _saved_bytes_total
    kvtier_connector_load_failed_blocks_total         blocks reported for recompute
    kvtier_connector_corrupt_chunks_total             chunks failing verification
    kvtier_connector_errors_total{op}                 failed tier calls (lookup|load|save|delete)
    kvtier_connector_calls_skipped_total{op}          calls refused by the open breaker
    kvtier_connector_saves_dropped_total{reason}      queue_full | tier_down
    kvtier_connector_breaker_opened_total             closed -> open transitions
    kvtier_connector_{lookup,load,save}_seconds       latency histograms
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Final

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

COUNTERS: Final[dict[str, tuple[str, str | None]]] = {
    # stat name: (documentation, label name or None)
    "lookups": ("Lookup round trips from the scheduler to the tier.", None),
    "requested_tokens": ("Prompt tokens beyond the local prefix cache asked of the tier.", None),
    "hit_tokens": ("Prompt tokens the tier could serve (block-aligned).", None),
    "loaded_chunks": ("Chunks loaded from the tier into KV blocks.", None),
    "loaded_bytes": ("Bytes of chunks loaded from the tier.", None),
    "saved_chunks": ("Chunks stored in the tier.", None),
    "saved_bytes": ("Bytes of chunks stored in the tier.", None),
    "load_failed_blocks": ("KV blocks whose load failed (recomputed by vLLM).", None),
    "corrupt_chunks": ("Chunks that failed verification (treated as misses, deleted).", None),
    "errors": ("Failed tier calls.", "op"),
    "calls_skipped": ("Tier calls refused by the open circuit breaker.", "op"),
    "saves_dropped": ("Chunk saves dropped instead of stalling the engine.", "reason"),
    "breaker_opened": ("Circuit breaker transitions from closed to open.", None),
}
HISTOGRAMS: Final[dict[str, str]] = {
    "lookup_seconds": "Latency of one Lookup call.",
    "load_seconds": "Latency of loading one request's chunks (Get, verify, copy).",
    "save_seconds": "Latency of one background Put batch.",
}
_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_PREFIX: Final = "kvtier_connector_"


class Recorder:
    """Thread-safe accumulation of one interval's observations."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, float] = {}
        self._histograms: dict[str, list[float]] = {}
        self._totals: dict[str, float] = {}

    def count(self, name: str, value: float = 1, label: str | None = None) -> None:
        assert name in COUNTERS, name
        key = f"{name}:{label}" if label is not None else name
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + value
            self._totals[key] = self._totals.get(key, 0) + value

    def observe(self, name: str, seconds: float) -> None:
        assert name in HISTOGRAMS, name
        with self._lock:
            self._histograms.setdefault(name, []).append(seconds)

    def total(self, name: str, label: str | None = None) -> float:
        """Everything counted under ``name`` since start (for logs and tests)."""
        key = f"{name}:{label}" if label is not None else name
        with self._lock:
            return self._totals.get(key, 0)

    def take(self) -> KvtierConnectorStats | None:
        """The interval's stats (then reset), or None when nothing happened."""
        with self._lock:
            if not self._counters and not self._histograms:
                return None
            data = {"counters": self._counters, "histograms": self._histograms}
            self._counters, self._histograms = {}, {}
        return KvtierConnectorStats(data=data)


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """``data = {"counters": {name[:label]: n}, "histograms": {name: [seconds]}}``."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("histograms", {})

    def reset(self) -> None:
        self.data = {"counters": {}, "histograms": {}}

    def aggregate(self, other: KVConnectorStats) -> KvtierConnectorStats:
        counters = self.data["counters"]
        for key, value in other.data.get("counters", {}).items():
            counters[key] = counters.get(key, 0) + value
        histograms = self.data["histograms"]
        for key, values in other.data.get("histograms", {}).items():
            histograms.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data["counters"])
        for key, values in self.data["histograms"].items():
            out[f"{key}_count"] = len(values)
            out[f"{key}_avg"] = round(sum(values) / len(values), 6) if values else 0.0
        return out

    def is_empty(self) -> bool:
        return not self.data["counters"] and not self.data["histograms"]


class KvtierPromMetrics(KVConnectorPromMetrics):
    """Prometheus series for the stats above, one set per vLLM engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}
        for name, (doc, label) in COUNTERS.items():
            self._counters[name] = self._counter_cls(
                name=_PREFIX + name,
                documentation=doc,
                labelnames=[*labelnames, label] if label else labelnames,
            )
        self._histograms: dict[str, Any] = {
            name: self._histogram_cls(
                name=_PREFIX + name, documentation=doc, labelnames=labelnames, buckets=_BUCKETS
            )
            for name, doc in HISTOGRAMS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = list(self.per_engine_labelvalues[engine_idx])
        for key, value in transfer_stats_data.get("counters", {}).items():
            name, _, label = key.partition(":")
            metric = self._counters.get(name)
            if metric is None:
                continue
            metric.labels(*labels, *([label] if label else [])).inc(value)
        for name, values in transfer_stats_data.get("histograms", {}).items():
            metric = self._histograms.get(name)
            if metric is None:
                continue
            series = metric.labels(*labels)
            for value in values:
                series.observe(value)
