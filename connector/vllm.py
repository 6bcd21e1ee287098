"""``KvtierConnector``: vLLM's KV connector for the kvtier cache tier (a thin front).

Loaded with::

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.connector.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"target": "127.0.0.1:50051"}}'

vLLM creates it twice: in the scheduler (role SCHEDULER, hands off to
``KvtierScheduler``) and in each worker (role WORKER, hands off to
``KvtierWorker``). Method map::

    scheduler  get_num_new_matched_tokens   keys + one Lookup -> block-aligned hit
               update_state_after_alloc     remember the blocks to load into
               build_connector_meta         this step's loads and saves
               request_finished             forget the request
    worker     register_kv_caches           the paged KV tensors
               start_load_kv                Get + verify + copy into blocks (before forward)
               wait_for_save                copy new full chunks out, queue them (after forward)
               get_block_ids_with_load_errors   blocks vLLM must recompute
    both       get_kv_connector_stats       metrics (see kvtier.connector.metrics)

kv_role ``kv_both`` loads and saves, ``kv_consumer`` only loads, ``kv_producer`` only
saves. A failed load is recomputed: the connector sets vLLM's
``kv_load_failure_policy`` to ``recompute`` (vLLM's default ``fail`` would fail the
request) and says so in the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtier.connector import metrics
from kvtier.connector.breaker import BreakerState, CircuitBreaker
from kvtier.connector.client import TierClient
from kvtier.connector.config import ConnectorConfig, check_item_identifiers
from kvtier.connector.errors import ConfigError, TierError
from kvtier.connector.keys import KeySpec
from kvtier.connector.metadata import StepPlan
from kvtier.connector.scheduler import KvtierScheduler
from kvtier.connector.worker import KvtierWorker

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["KvtierConnector", "KvtierConnectorMetadata", "KvtierConnectorStats"]


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """vLLM's envelope for one step's plan (scheduler -> workers)."""

    plan: StepPlan


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """vLLM's envelope for the connector's metrics (``kvtier.connector.metrics.Stats``)."""

    data: dict[str, Any] = field(default_factory=metrics.empty)

    def reset(self) -> None:
        self.data = metrics.empty()

    def aggregate(self, other: KVConnectorStats) -> KvtierConnectorStats:
        metrics.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return metrics.summarize(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(part) for part in ("counters", "histograms", "gauges"))


class KvtierPromMetrics(KVConnectorPromMetrics):
    """The kvtier_connector_* series on vLLM's /metrics, one set per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series = metrics.PromSeries(
            self._counter_cls, self._histogram_cls, labelnames, gauge_cls=self._gauge_cls
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._series.observe(transfer_stats_data, self.per_engine_labelvalues[engine_idx])


class KvtierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        specs = _key_specs(config, vllm_config, kv_cache_config)
        self._recorder = metrics.Recorder()
        self._breaker = CircuitBreaker(
            config.breaker_failures,
            config.breaker_cooldown_s,
            on_open=lambda: self._recorder.count("breaker_opened"),
        )
        self._client = TierClient(
            config.target,
            timeout_s=config.load_timeout_s,
            token=config.token,
            token_file=config.auth_token_file,
            tls_ca_file=config.tls_ca_file,
            tls_cert_file=config.tls_cert_file,
            tls_key_file=config.tls_key_file,
            receive_buffer_bytes=config.receive_buffer_bytes,
        )
        load, save = bool(transfer.is_kv_consumer), bool(transfer.is_kv_producer)
        self._scheduler: KvtierScheduler | None = None
        self._worker: KvtierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                logger.warning(
                    "kvtier: setting kv_load_failure_policy=recompute (was %r): a chunk the "
                    "tier cannot deliver is recomputed, never a failed request",
                    transfer.kv_load_failure_policy,
                )
                transfer.kv_load_failure_policy = "recompute"
            self._scheduler = KvtierScheduler(
                config, specs, self._client, breaker=self._breaker, recorder=self._recorder,
                load=load, save=save,
            )  # fmt: skip
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            group = kv_cache_config.kv_cache_groups[0]
            self._worker = KvtierWorker(
                config,
                self._client,
                rank=get_tensor_model_parallel_rank(),
                num_blocks=kv_cache_config.num_blocks,
                layer_order=group.layer_names,
                breaker=self._breaker,
                recorder=self._recorder,
            )
        logger.info(
            "kvtier: %s connector for %s, tier %s, chunk %d tokens, load=%s save=%s",
            role.name.lower(), specs[0].model_id, config.target, config.chunk_size, load, save,
        )  # fmt: skip
        self._warm_up(config)

    def _warm_up(self, config: ConnectorConfig) -> None:
        """Open the connection now, so the first request's Lookup does not pay for it
        (and the log says at once whether the tier is reachable)."""
        try:
            self._client.lookup([bytes(32)], timeout_s=min(2.0, config.load_timeout_s))
        except TierError as exc:
            logger.warning(
                "kvtier: tier %s not reachable at start (%s); requests recompute until it is",
                config.target,
                exc,
            )
        else:
            logger.info("kvtier: tier %s reachable", config.target)

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future miss, nothing more.
        return False

    @property
    def recorder(self) -> metrics.Recorder:
        """This half's metrics (``recorder.totals()``: everything since start)."""
        return self._recorder

    @property
    def scheduler(self) -> KvtierScheduler:
        assert self._scheduler is not None, "called on the worker-side connector"
        return self._scheduler

    @property
    def worker(self) -> KvtierWorker:
        assert self._worker is not None, "called on the scheduler-side connector"
        return self._worker

    # -- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KvtierConnectorMetadata(self.scheduler.build_connector_meta(scheduler_output))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request)
        return False, None

    # -- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        self.worker.start_load_kv(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        self.worker.wait_for_save(meta.plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.failed_blocks()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        self._client.close()

    # -- metrics --------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
        # Every call (every step) carries the breaker's state, so the merged stats of a
        # step hold the state of every half (the gauge is their max).
        self._recorder.set("breaker_open", int(self._breaker.state is not BreakerState.CLOSED))
        data = self._recorder.take()
        return KvtierConnectorStats(data=data) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierConnectorStats:
        stats = KvtierConnectorStats()
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
    ) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _key_specs(config: ConnectorConfig, vllm_config: Any, kv_cache_config: Any) -> list[KeySpec]:
    """One KeySpec per tensor-parallel rank, pinning what makes this engine's KV meaningful."""
    from vllm.platforms import current_platform

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"kvtier supports models with one KV cache group, this one has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    if not hasattr(spec, "num_kv_heads"):
        raise ConfigError(f"kvtier supports attention KV caches, not {type(spec).__name__}")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError("kvtier does not support pipeline parallelism yet")
    config.check_block_size(spec.block_size)
    check_item_identifiers(vllm_config, "KvtierConnector")
    model = vllm_config.model_config
    layout = (
        f"{current_platform.device_type}:layers={len(groups[0].layer_names)}"
        f":kv_heads={spec.num_kv_heads}:head_size={spec.head_size}"
    )
    tp = parallel.tensor_parallel_size
    return [
        KeySpec(
            model_id=config.model_id or model.model,
            model_revision=model.revision or "",
            kv_dtype=str(spec.dtype).removeprefix("torch."),
            kv_layout=layout,
            block_size=spec.block_size,
            chunk_size=config.chunk_size,
            tp_rank=rank,
            tp_world_size=tp,
            hash_algo=config.hash_algo,
            salt=config.salt or "",
        )
        for rank in range(tp)
    ]
