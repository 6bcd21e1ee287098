"""``KvtierECConnector``: vLLM's encoder-cache (EC) connector for the kvtier tier (a thin front).

Loaded with::

    --ec-transfer-config '{"ec_connector": "KvtierECConnector",
                           "ec_connector_module_path": "kvtier.connector.ec",
                           "ec_role": "ec_both",
                           "ec_connector_extra_config": {"target": "127.0.0.1:50051"}}'

``ec_connector_extra_config`` takes the KV connector's keys (``ConnectorConfig``:
``target``, token, deadlines, breaker, ``salt_policy``, ``hash_algo``, ...); keys only
the KV side uses are accepted and ignored, so the operator passes one dict to both.
It runs beside the KV connector (``--kv-transfer-config``) or alone, and reaches the
tier as the KV connector does (``kvtier.connector.factory``: the same client
settings, breaker and warm-up).

vLLM creates it in the scheduler (role SCHEDULER, hands off to
``KvtierECScheduler``) and in each worker (role WORKER, hands off to
``KvtierECWorker``). Method map::

    scheduler  ensure_cache_available   note the items not yet computed (encoder.scheduler)
               has_cache_item           fetch a noted item (one Get), verify: True if in hand
               update_state_after_alloc load it, or plan to save the new output
               build_connector_meta     this step's loads and save keys
               update_connector_output  the workers' metrics, added to its own
               get_ec_connector_stats   metrics (``kvtier.connector.metrics.EC``)
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

from kvtier.connector import factory, metrics
from kvtier.connector.chunks.encoder_keys import EncoderKeySpec, processor_fingerprint
from kvtier.connector.config import ConnectorConfig, check_item_identifiers
from kvtier.connector.encoder.plan import ECStepPlan
from kvtier.connector.encoder.scheduler import KvtierECScheduler
from kvtier.connector.encoder.worker import KvtierECWorker
from kvtier.connector.errors import ConfigError

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
class KvtierECConnectorStats(metrics.StatsEnvelope, ECConnectorStats):
    """vLLM's envelope for the connector's metrics (``kvtier.connector.metrics.Stats``)."""

    data: dict[str, Any] = field(default_factory=metrics.empty)


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
        self._series = metrics.PromSeries(
            self._counter_cls,
            self._histogram_cls,
            labelnames,
            series=metrics.EC,
            gauge_cls=self._gauge_cls,
        )
        for labelvalues in per_engine_labelvalues.values():
            self._series.initialize(labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._series.observe(transfer_stats_data, self.per_engine_labelvalues[engine_idx])


class KvtierECConnector(ECConnectorBase):
    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        transfer = vllm_config.ec_transfer_config
        config = ConnectorConfig.from_extra_config(
            transfer.ec_connector_extra_config, name="ec_connector_extra_config"
        )
        if getattr(vllm_config.model_config, "is_encoder_decoder", False):
            raise ConfigError(
                "KvtierECConnector caches the encoder outputs of multimodal decoder models; "
                f"{vllm_config.model_config.model} is an encoder-decoder model: remove "
                "--ec-transfer-config (or set the recipe's cache.encoderCache to false)"
            )
        check_item_identifiers(vllm_config, "KvtierECConnector")
        self._tier = factory.connect(config, metrics.EC)
        self._worker_stats: list[dict[str, Any]] = []
        self._scheduler: KvtierECScheduler | None = None
        self._worker: KvtierECWorker | None = None
        if role == ECConnectorRole.SCHEDULER:
            spec = _key_spec(config, vllm_config)
            self._scheduler = KvtierECScheduler(
                config, spec, self._tier.client, breaker=self._tier.breaker,
                recorder=self._tier.recorder, load=self.is_consumer, save=self.is_producer,
                widths=dict(transfer.mm_encoder_output_widths),
            )  # fmt: skip
            what = spec.model_id
        else:
            self._worker = KvtierECWorker(
                config,
                self._tier.client,
                device=_device(),
                breaker=self._tier.breaker,
                recorder=self._tier.recorder,
                save=_tp_rank() == 0,  # every rank holds the same output: one saves it
            )
            what = "worker"
        logger.info(
            "kvtier: encoder-cache %s connector (%s), tier %s, load=%s save=%s",
            role.name.lower(), what, config.target, self.is_consumer, self.is_producer,
        )  # fmt: skip
        self._tier.warm_up(config, "encoders run")

    @property
    def recorder(self) -> metrics.Recorder:
        """This half's metrics (``recorder.totals()``: everything since start)."""
        return self._tier.recorder

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
        self._tier.close()

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
        data = self._tier.take_stats()
        return KvtierECWorkerMetadata(stats=data) if data is not None else None

    def _plan(self) -> ECStepPlan | None:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, KvtierECConnectorMetadata) else None

    # -- metrics --------------------------------------------------------------------

    def get_ec_connector_stats(self) -> KvtierECConnectorStats | None:
        # Merged with the workers' (max), the breaker gauge is behind the CircuitOpen alert.
        data = self._tier.take_stats()
        pending, self._worker_stats = self._worker_stats, []
        if data is None and not pending:
            return None
        stats = KvtierECConnectorStats.of(data)
        for other in pending:
            metrics.merge(stats.data, other)
        return stats

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierECConnectorStats:
        return KvtierECConnectorStats.of(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvtierECPromMetrics:
        return KvtierECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _key_spec(config: ConnectorConfig, vllm_config: Any) -> EncoderKeySpec:
    """What makes this engine's encoder outputs meaningful (pinned in every key)."""
    model = vllm_config.model_config
    mm_config = getattr(model, "multimodal_config", None)
    processor_kwargs = getattr(mm_config, "mm_processor_kwargs", None)
    return EncoderKeySpec(
        model_id=config.model_id or model.model,
        model_revision=model.revision or "",
        encoder_dtype=str(model.dtype).removeprefix("torch."),
        processor=processor_fingerprint(processor_kwargs, model.model),
        hash_algo=config.hash_algo,
    )


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
