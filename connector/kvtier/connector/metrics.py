"""The metrics of both vLLM connectors, reported through vLLM's connector-stats hooks.

Each connector half records into a ``Recorder``; vLLM collects ``Recorder.take()``
every engine step and ships it to the front-end process, which hands it to
``PromSeries.observe``: Prometheus series served on vLLM's own ``/metrics`` (the API
server's port), with vLLM's ``model_name``/``engine`` labels. This module does not
import vLLM. Two sets of series (``Series``), one per connector:

- ``KV``, the KV connector (``kvtier.connector.vllm``): vLLM collects from both
  halves (``get_kv_connector_stats``, wrapped in ``KvtierConnectorStats``).
- ``EC``, the encoder-cache connector (``kvtier.connector.ec``): vLLM collects only
  from its scheduler half (``get_ec_connector_stats``), so the worker half hands its
  interval's stats to the scheduler half in its per-step worker metadata
  (``build_connector_worker_meta`` -> ``update_connector_output``), which adds them
  to its own.

KV series (counters get ``_total``)::

    kvtier_connector_lookups_total                    Lookup round trips
    kvtier_connector_lookup_chunks_total              full prompt chunks Lookup asked about
    kvtier_connector_lookup_hit_chunks_total          of those, the leading ones the tier held
    kvtier_connector_requested_tokens_total           prompt tokens asked about
    kvtier_connector_hit_tokens_total                 tokens the tier could serve
    kvtier_connector_loaded_chunks_total / _loaded_bytes_total
    kvtier_connector_saved_chunks_total / _saved_bytes_total
    kvtier_connector_load_failed_blocks_total         blocks reported for recompute
    kvtier_connector_corrupt_chunks_total{reason}     chunks failing verification (errors.CHUNK_ERROR_REASONS)
    kvtier_connector_requests_skipped_total{reason}   bad_input | no_salt
    kvtier_connector_errors_total{op}                 failed tier calls (lookup|load|save|delete)
    kvtier_connector_calls_skipped_total{op}          calls refused by the open breaker
    kvtier_connector_saves_dropped_total{reason}      queue_full | tier_down | load_failed | nonfinite
    kvtier_connector_breaker_opened_total             closed -> open transitions
    kvtier_connector_breaker_open                     gauge: 1 while a circuit breaker of the
                                                      engine (scheduler or any worker) is not
                                                      closed, else 0
    kvtier_connector_{lookup,load,save}_seconds       latency histograms

Encoder-cache series::

    kvtier_connector_ec_lookups_total             items asked of the tier (vLLM's encoder cache lacked them)
    kvtier_connector_ec_hits_total                items found and verified: their encoder is skipped
    kvtier_connector_ec_loaded_bytes_total        bytes of verified entries loaded
    kvtier_connector_ec_saved_chunks_total        encoder outputs stored (one entry each)
    kvtier_connector_ec_saved_bytes_total         bytes stored
    kvtier_connector_ec_corrupt_chunks_total      entries failing verification (misses, deleted)
    kvtier_connector_ec_errors_total{op}          failed tier calls (load|save|delete)
    kvtier_connector_ec_calls_skipped_total{op}   calls refused by the open breaker
    kvtier_connector_ec_saves_dropped_total{reason}   queue_full | tier_down | unsupported | nonfinite
    kvtier_connector_ec_breaker_opened_total      closed -> open transitions
    kvtier_connector_ec_breaker_open              gauge: 1 while a breaker of the encoder
                                                  cache (scheduler or a worker) is not closed
    kvtier_connector_ec_{load,save}_seconds       latency histograms

Gauges are current values, not deltas: each half sets them every time vLLM collects
its stats (every engine step), so the step's merged stats carry the value of every
half, merged with ``max``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Self

Stats = dict[str, Any]
"""``{"counters": {name[:label]: n}, "histograms": {name: [seconds]}, "gauges": {name: v}}``
(serializable; ``gauges`` only when set)."""

COUNTERS: Final[dict[str, tuple[str, str | None]]] = {
    # The KV connector's; stat name: (documentation, label name or None)
    "lookups": ("Lookup round trips from the scheduler to the tier.", None),
    "lookup_chunks": ("Full prompt chunks asked about by successful Lookups.", None),
    "lookup_hit_chunks": ("Leading chunks those Lookups found in the tier.", None),
    "requested_tokens": ("Prompt tokens beyond the local prefix cache asked of the tier.", None),
    "hit_tokens": ("Prompt tokens the tier could serve (block-aligned).", None),
    "loaded_chunks": ("Chunks loaded from the tier into KV blocks.", None),
    "loaded_bytes": ("Bytes of chunks loaded from the tier.", None),
    "saved_chunks": ("Chunks stored in the tier.", None),
    "saved_bytes": ("Bytes of chunks stored in the tier.", None),
    "load_failed_blocks": ("KV blocks whose load failed (recomputed by vLLM).", None),
    "corrupt_chunks": (
        "Chunks that failed verification (treated as misses, deleted), by reason.",
        "reason",
    ),
    "requests_skipped": ("Requests neither looked up nor saved, by reason.", "reason"),
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
GAUGES: Final[dict[str, str]] = {
    "breaker_open": "1 while a circuit breaker of the connector refuses tier calls, else 0.",
}
EC_COUNTERS: Final[dict[str, tuple[str, str | None]]] = {
    "lookups": ("Multimodal items asked of the tier's encoder cache.", None),
    "hits": ("Items whose verified encoder output was loaded (encoder skipped).", None),
    "loaded_bytes": ("Bytes of encoder outputs loaded from the tier.", None),
    "saved_chunks": ("Encoder outputs stored in the tier (one entry per item).", None),
    "saved_bytes": ("Bytes of encoder outputs stored in the tier.", None),
    "corrupt_chunks": ("Entries that failed verification (treated as misses, deleted).", None),
    "errors": ("Failed tier calls of the encoder cache.", "op"),
    "calls_skipped": ("Encoder-cache tier calls refused by the open circuit breaker.", "op"),
    "saves_dropped": ("Encoder-output saves dropped instead of stalling the engine.", "reason"),
    "breaker_opened": ("Encoder-cache circuit breaker transitions from closed to open.", None),
}
EC_HISTOGRAMS: Final[dict[str, str]] = {
    "load_seconds": "Latency of fetching one request's encoder outputs (Get and verify).",
    "save_seconds": "Latency of one background Put batch of encoder outputs.",
}
EC_GAUGES: Final[dict[str, str]] = {
    "breaker_open": "1 while a circuit breaker of the encoder cache refuses tier calls, else 0.",
}
BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class Series:
    """One connector's series: the stat names its ``Recorder`` accepts, and their
    Prometheus names (``prefix`` + name, counters + ``_total``) and help texts."""

    prefix: str
    counters: Mapping[str, tuple[str, str | None]]
    """stat name: (documentation, label name or None)"""
    histograms: Mapping[str, str]
    gauges: Mapping[str, str]


KV: Final = Series("kvtier_connector_", COUNTERS, HISTOGRAMS, GAUGES)
EC: Final = Series("kvtier_connector_ec_", EC_COUNTERS, EC_HISTOGRAMS, EC_GAUGES)


class Recorder:
    """Thread-safe accumulation of one interval's observations of one ``Series``
    (default: the KV connector's)."""

    def __init__(self, series: Series = KV) -> None:
        self.series = series
        self._gauges: dict[str, float] = {}
        self._lock = threading.Lock()
        self._counters: dict[str, float] = {}
        self._histograms: dict[str, list[float]] = {}
        self._totals: dict[str, float] = {}

    def count(self, name: str, value: float = 1, label: str | None = None) -> None:
        assert name in self.series.counters, name
        key = f"{name}:{label}" if label is not None else name
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + value
            self._totals[key] = self._totals.get(key, 0) + value

    def observe(self, name: str, seconds: float) -> None:
        assert name in self.series.histograms, name
        with self._lock:
            self._histograms.setdefault(name, []).append(seconds)

    def set(self, name: str, value: float) -> None:
        """A gauge's current value; reported with every ``take()`` from now on."""
        assert name in self.series.gauges, name
        with self._lock:
            self._gauges[name] = value

    def total(self, name: str, label: str | None = None) -> float:
        """Everything counted under ``name`` since start (for logs and tests)."""
        key = f"{name}:{label}" if label is not None else name
        with self._lock:
            return self._totals.get(key, 0)

    def totals(self) -> dict[str, float]:
        """Counters since start, and the gauges' current values."""
        with self._lock:
            return {**self._totals, **self._gauges}

    def take(self) -> Stats | None:
        """The interval's stats (then reset), or None when nothing happened and no
        gauge is set."""
        with self._lock:
            if not self._counters and not self._histograms and not self._gauges:
                return None
            data: Stats = {"counters": self._counters, "histograms": self._histograms}
            if self._gauges:
                data["gauges"] = dict(self._gauges)
            self._counters, self._histograms = {}, {}
        return data


def empty() -> Stats:
    return {"counters": {}, "histograms": {}}


def merge(into: Stats, other: Stats) -> None:
    """Add ``other``'s observations to ``into`` (counters sum, histograms concatenate)."""
    counters = into.setdefault("counters", {})
    for key, value in other.get("counters", {}).items():
        counters[key] = counters.get(key, 0) + value
    histograms = into.setdefault("histograms", {})
    for key, values in other.get("histograms", {}).items():
        histograms.setdefault(key, []).extend(values)
    if other.get("gauges"):
        gauges = into.setdefault("gauges", {})
        for key, value in other["gauges"].items():
            gauges[key] = max(value, gauges.get(key, value))


def summarize(data: Stats) -> dict[str, int | float]:
    """One line's worth for vLLM's periodic log: counters, and count/avg per histogram."""
    out: dict[str, int | float] = dict(data.get("counters", {}))
    out.update(data.get("gauges", {}))
    for key, values in data.get("histograms", {}).items():
        out[f"{key}_count"] = len(values)
        out[f"{key}_avg"] = round(sum(values) / len(values), 6) if values else 0.0
    return out


class StatsEnvelope:
    """The methods of vLLM's connector-stats envelopes (``KVConnectorStats``,
    ``ECConnectorStats``) over the ``Stats`` in ``self.data``: both connectors'
    envelope classes mix it in before vLLM's base class."""

    data: Stats

    @classmethod
    def of(cls, data: Stats | None) -> Self:
        """An envelope holding ``data`` (empty for None)."""
        stats = cls()
        if data is not None:
            merge(stats.data, data)
        return stats

    def reset(self) -> None:
        self.data = empty()

    def aggregate(self, other: Any) -> Self:
        merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summarize(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(part) for part in ("counters", "histograms", "gauges"))


class PromSeries:
    """The Prometheus series of one ``Series`` (default: the KV connector's), created
    with the metric classes vLLM hands over (gauges only with a ``gauge_cls``)."""

    def __init__(
        self,
        counter_cls: Any,
        histogram_cls: Any,
        labelnames: list[str],
        *,
        series: Series = KV,
        gauge_cls: Any = None,
    ) -> None:
        prefix, counters, histograms = series.prefix, series.counters, series.histograms
        self._gauges = {
            name: gauge_cls(
                name=prefix + name,
                documentation=doc,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            for name, doc in (series.gauges.items() if gauge_cls is not None else ())
        }
        self._counters = {
            name: counter_cls(
                name=prefix + name,
                documentation=doc,
                labelnames=[*labelnames, label] if label else labelnames,
            )
            for name, (doc, label) in counters.items()
        }
        self._labels = {name: label for name, (_, label) in counters.items()}
        self._histograms = {
            name: histogram_cls(
                name=prefix + name, documentation=doc, labelnames=labelnames, buckets=BUCKETS
            )
            for name, doc in histograms.items()
        }

    def initialize(self, labelvalues: list[object]) -> None:
        """Create the unlabelled series of one engine at zero, so they are scraped (and
        graphed) before the first observation."""
        for name, counter in self._counters.items():
            if self._labels.get(name) is None:
                counter.labels(*labelvalues)
        for histogram in self._histograms.values():
            histogram.labels(*labelvalues)
        for gauge in self._gauges.values():
            gauge.labels(*labelvalues)

    def observe(self, data: Stats, labelvalues: list[object]) -> None:
        for key, value in data.get("counters", {}).items():
            name, _, label = key.partition(":")
            counter = self._counters.get(name)
            if counter is not None:
                counter.labels(*labelvalues, *([label] if label else [])).inc(value)
        for name, values in data.get("histograms", {}).items():
            histogram = self._histograms.get(name)
            if histogram is not None:
                series = histogram.labels(*labelvalues)
                for value in values:
                    series.observe(value)
        for name, value in data.get("gauges", {}).items():
            gauge = self._gauges.get(name)
            if gauge is not None:
                gauge.labels(*labelvalues).set(value)
