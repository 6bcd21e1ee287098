"""The encoder-cache connector's metrics (``kvtier_connector_ec_*`` on vLLM's /metrics).

They travel like the KV connector's (``kvtier.connector.metrics``), through vLLM's
EC-connector stats hooks: vLLM only collects stats from the scheduler-side EC
connector (``get_ec_connector_stats``), so the worker half hands its interval's
stats to the scheduler half in its per-step worker metadata
(``build_connector_worker_meta`` -> ``update_connector_output``), which adds them to
its own. vLLM ships the sum to the front-end process and hands it to
``build_prom_metrics``'s ``observe``. This module does not import vLLM.

Series (counters get ``_total``)::

    kvtier_connector_ec_lookups_total             items asked of the tier (vLLM's encoder cache lacked them)
    kvtier_connector_ec_hits_total                items found and verified: their encoder is skipped
    kvtier_connector_ec_loaded_bytes_total        bytes of verified entries loaded
    kvtier_connector_ec_saved_chunks_total        encoder outputs stored (one entry each)
    kvtier_connector_ec_saved_bytes_total         bytes stored
    kvtier_connector_ec_corrupt_chunks_total      entries failing verification (misses, deleted)
    kvtier_connector_ec_errors_total{op}          failed tier calls (load|save|delete)
    kvtier_connector_ec_calls_skipped_total{op}   calls refused by the open breaker
    kvtier_connector_ec_saves_dropped_total{reason}   queue_full | tier_down | unsupported
    kvtier_connector_ec_breaker_opened_total      closed -> open transitions
    kvtier_connector_ec_breaker_open              gauge: 1 while a breaker of the encoder
                                                  cache (scheduler or a worker) is not closed
    kvtier_connector_ec_{load,save}_seconds       latency histograms
"""

from __future__ import annotations

from typing import Final

from kvtier.connector.metrics import PromSeries, Recorder

PREFIX: Final = "kvtier_connector_ec_"

COUNTERS: Final[dict[str, tuple[str, str | None]]] = {
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
GAUGES: Final[dict[str, str]] = {
    "breaker_open": "1 while a circuit breaker of the encoder cache refuses tier calls, else 0.",
}
HISTOGRAMS: Final[dict[str, str]] = {
    "load_seconds": "Latency of fetching one request's encoder outputs (Get and verify).",
    "save_seconds": "Latency of one background Put batch of encoder outputs.",
}


def recorder() -> Recorder:
    return Recorder(COUNTERS, HISTOGRAMS, GAUGES)


def prom_series(
    counter_cls: object, histogram_cls: object, gauge_cls: object, labelnames: list[str]
) -> PromSeries:
    return PromSeries(
        counter_cls,
        histogram_cls,
        labelnames,
        counters=COUNTERS,
        histograms=HISTOGRAMS,
        prefix=PREFIX,
        gauge_cls=gauge_cls,
        gauges=GAUGES,
    )
