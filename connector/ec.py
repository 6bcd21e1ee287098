"""``KvtierECConnector``: vLLM's encoder-cache (EC) connector for the kvtier tier (a thin front).

Loaded with::

    --ec-transfer-config '{"ec_connector": "KvtierECConnector",
                           "ec_connector_module_path": "kvtier.connector.ec",
                           "ec_role": "ec_both",
                           "ec_connector_extra_config": {"target": "127.0.0.1:50051"}}'

``ec_connector_extra_config`` takes the KV connector's keys (``ConnectorConfig``:
``target``, token, deadlines, breaker, ``salt_policy``, ``hash_algo``, ...); keys only
the KV side uses are accepted and ignored, so the operator passes one dict to both.
It runs beside the KV connector (``--kv-transfer-config``) or alone.

vLLM creates it in the scheduler (role SCHEDULER, hands off to
``KvtierECScheduler``) and in each worker (role WORKER, hands off to
``KvtierECWorker``). Method map::

    scheduler  ensure_cache_available   note the items not yet computed (ec_scheduler)
               has_cache_item           fetch a noted item (one Get), verify: True if in hand
               update_state_after_alloc load it, or plan to save the new output
               build_connector_meta     this step's loads and save keys
               update_connector_output  the workers' metrics, added to its own
               get_ec_connector_stats   metrics (see kvtier.connector.ec_metrics)
               request_finished         forget the request
    worker     start_load_caches        verified payloads -> vLLM's encoder cache
               save_caches              new encoder output -> background Put
               build_connector_worker_meta   this step's worker metrics

``ec_role`` ``ec_both`` loads and saves, ``ec_consumer`` only loads; ``ec_producer``
alone makes vLLM an encode-only instance (no language model): use ``ec_both``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

from kvtier.connector import ec_metrics, metrics
from kvtier.connector.breaker import BreakerState, CircuitBreaker
from kvtier.connector.client import TierClient
from kvtier.connector.config import ConnectorConfig, check_item_identifiers
from kvtier.connector.ec_config import key_spec, parse_config
from kvtier.connector.ec_scheduler import ECStepPlan, KvtierECScheduler
from kvtier.connector.ec_worker import KvtierECWorker
from kvtier.connector.errors import ConfigError, TierError

logger = logging.getLogger(__name__)

__all__ = [
    "KvtierECConnector",
    "KvtierECConnectorMetadata",
    "KvtierECConnectorStats",
    "KvtierECWorkerMetadata",
]


@dataclass
class KvtierECConnectorMetadata(ECConnectorMetadata):
    """vLLM's envelope for one step's plan (scheduler -> workers)."""

    plan: ECStepPlan


@dataclass
class KvtierECWorkerMetadata(ECConnectorWorkerMetadata):
    """A worker's metrics of one step (workers -> scheduler, summed over workers)."""

    stats: dict[str, Any] = field(default_factory=metrics.empty)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> KvtierECWorkerMetadata:
        if isinstance(other, KvtierECWorkerMetadata):
            metrics.merge(self.stats, other.stats)
        return self


@dataclass
class KvtierECConnectorStats(ECConnectorStats):
    """vLLM's envelope for the connector's metrics (``kvtier.connector.metrics.Stats``)."""

    data: dict[str, Any] = field(default_factory=metrics.empty)

    def reset(self) -> None:
        self.data = metrics.empty()

    def aggregate(self, other: ECConnectorStats) -> KvtierECConnectorStats:
        metrics.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return metrics.summarize(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(part) for part in ("counters", "histograms", "gauges"))


class KvtierECPromMetrics(ECConnectorPromMetrics):
    """The kvtier_connector_ec_* series on vLLM's /metrics, one set per engine, created at
    zero so a dashboard shows 0 rather than "No data" before the first image."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series = ec_metrics.prom_series(
            self._counter_cls, self._histogram_cls, self._gauge_cls, labelnames
        )
        for labelvalues in per_engine_labelvalues.values():
            self._series.initialize(labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._series.observe(transfer_stats_data, self.per_engine_labelvalues[engine_idx])


class KvtierECConnector(ECConnectorBase):
    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        transfer = vllm_config.ec_transfer_config
        config = parse_config(transfer.ec_connector_extra_config)
        if getattr(vllm_config.model_config, "is_encoder_decoder", False):
            raise ConfigError(
                "KvtierECConnector caches the encoder outputs of multimodal decoder models; "
                f"{vllm_config.model_config.model} is an encoder-decoder model: remove "
                "--ec-transfer-config (or set the recipe's cache.encoderCache to false)"
            )
        check_item_identifiers(vllm_config, "KvtierECConnector")
        self._recorder = ec_metrics.recorder()
        self._breaker = CircuitBreaker(
            config.breaker_failures,
            config.breaker_cooldown_s,
            on_open=lambda: self._recorder.count("breaker_opened"),
        )
        # A token file (a mounted Secret) is read again when the tier says UNAUTHENTICATED.
        token_file = getattr(config, "auth_token_file", None)
        rotation: dict[str, Any] = {"token_file": token_file} if token_file else {}
        self._client = TierClient(
            config.target, timeout_s=config.load_timeout_s, token=config.token,
            tls_ca_file=config.tls_ca_file, tls_cert_file=config.tls_cert_file,
            tls_key_file=config.tls_key_file, **rotation,
        )  # fmt: skip
        self._worker_stats: list[dict[str, Any]] = []
        self._scheduler: KvtierECScheduler | None = None
        self._worker: KvtierECWorker | None = None
        if role == ECConnectorRole.SCHEDULER:
            spec = key_spec(config, vllm_config)
            self._scheduler = KvtierECScheduler(
                config, spec, self._client, breaker=self._breaker, recorder=self._recorder,
                load=self.is_consumer, save=self.is_producer,
                widths=dict(transfer.mm_encoder_output_widths),
            )  # fmt: skip
            what = spec.model_id
        else:
            self._worker = KvtierECWorker(
                config,
                self._client,
                device=_device(),
                breaker=self._breaker,
                recorder=self._recorder,
                save=_tp_rank() == 0,  # every rank holds the same output: one saves it
            )
            what = "worker"
        logger.info(
            "kvtier: encoder-cache %s connector (%s), tier %s, load=%s save=%s",
            role.name.lower(), what, config.target, self.is_consumer, self.is_producer,
        )  # fmt: skip
        self._warm_up(config)

    def _warm_up(self, config: ConnectorConfig) -> None:
        """Open the connection now, so the first image does not pay for it."""
        try:
            self._client.lookup([bytes(32)], timeout_s=min(2.0, config.lookup_timeout_s))
        except TierError as exc:
            logger.warning(
                "kvtier: tier %s not reachable at start (%s); encoders run until it is",
                config.target,
                exc,
            )

    @property
    def recorder(self) -> metrics.Recorder:
        """This half's metrics (``recorder.totals()``: everything since start)."""
        return self._recorder

    @property
    def scheduler(self) -> KvtierECScheduler:
        assert self._scheduler is not None, "called on the worker-side connector"
        return self._scheduler

    @property
    def worker(self) -> KvtierECWorker:
        assert self._worker is not None, "called on the scheduler-side connector"
        return self._worker

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        self._client.close()

    # -- scheduler side -------------------------------------------------------------

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        return self.scheduler.ensure_cache_available(request, num_computed_tokens)

    def has_cache_item(self, identifier: str) -> bool:
        return self.scheduler.has_cache_item(identifier)

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        self.scheduler.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: Any) -> ECConnectorMetadata:
        return KvtierECConnectorMetadata(self.scheduler.build_connector_meta())

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(meta, KvtierECWorkerMetadata) and meta.stats:
            self._worker_stats.append(meta.stats)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request)
        return False, None

    # -- worker side ----------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None:
            self.worker.load(plan, encoder_cache)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        plan = self._plan()
        if plan is not None and self.is_producer:
            self.worker.save(plan, encoder_cache, mm_hash)

    def build_connector_worker_meta(self) -> KvtierECWorkerMetadata | None:
        self._set_breaker_gauge()
        data = self._recorder.take()
        return KvtierECWorkerMetadata(stats=data) if data is not None else None

    def _plan(self) -> ECStepPlan | None:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, KvtierECConnectorMetadata) else None

    # -- metrics --------------------------------------------------------------------

    def _set_breaker_gauge(self) -> None:
        self._recorder.set("breaker_open", int(self._breaker.state is not BreakerState.CLOSED))

    def get_ec_connector_stats(self) -> KvtierECConnectorStats | None:
        # Every call (every step) carries the breaker's state, as the KV connector does;
        # merged with the workers' (max), it is the gauge behind the CircuitOpen alert.
        self._set_breaker_gauge()
        data = self._recorder.take()
        pending, self._worker_stats = self._worker_stats, []
        if data is None and not pending:
            return None
        stats = KvtierECConnectorStats(data=data or metrics.empty())
        for other in pending:
            metrics.merge(stats.data, other)
        return stats

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierECConnectorStats:
        stats = KvtierECConnectorStats()
        if data is not None:
            metrics.merge(stats.data, data)
        return stats

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvtierECPromMetrics:
        return KvtierECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except AssertionError:  # no tensor-parallel group: a single worker
        return 0


def _device() -> str:
    from vllm.platforms import current_platform

    device = str(current_platform.device_type)
    if current_platform.is_cuda_alike():
        device = f"{device}:{current_platform.current_device()}"
    return device
