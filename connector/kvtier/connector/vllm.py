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
               request_finished(_all_groups)    forget the request
               update_connector_output      forget the hits of failed loads (reported
                                            ones, and blocks a load left unfilled)
    worker     register_kv_caches           the paged KV tensors, their layout (kv/layouts.py)
               start_load_kv                Get + verify, copies into blocks enqueued (before forward)
               wait_for_layer_load          the forward waits for that layer's copies
               save_kv_layer                that layer's new full chunks copied out (behind it)
               wait_for_save                wait for the save copies, queue the chunks (after
                                            forward; none after a failed load: kv/worker.py)
               get_block_ids_with_load_errors   blocks vLLM must recompute
               get_transfer_results         reported loads done, and failed (several groups)
    both       get_kv_connector_stats       metrics (see kvtier.connector.metrics)

It supports vLLM's hybrid KV cache manager (``SupportsHMA``): a model with several kinds
of attention (Gemma 3: sliding-window and full) gets one KV cache group per kind, and
kvtier stores and loads each group's blocks apart, a sliding-window group only the
blocks a hit keeps (``kvtier.connector.kv.groups``; docs/connector.md "Hybrid models").

kv_role ``kv_both`` loads and saves, ``kv_consumer`` only loads, ``kv_producer`` only
saves. On a GPU the copies follow the forward layer by layer (``layerwise``, the
default), so vLLM is told to run CUDA graphs piecewise
(``requires_piecewise_for_cudagraph``). A failed load is recomputed: the connector sets vLLM's
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
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtier.connector import factory, metrics
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.errors import ConfigError
from kvtier.connector.kv import vllmspec
from kvtier.connector.kv.layouts import KVOrder, family_of
from kvtier.connector.kv.plan import StepPlan
from kvtier.connector.kv.scheduler import KvtierScheduler
from kvtier.connector.kv.worker import KvtierWorker

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["KvtierConnector", "KvtierConnectorMetadata", "KvtierConnectorStats"]


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """vLLM's envelope for one step's plan (scheduler -> workers)."""

    plan: StepPlan


@dataclass
class KvtierConnectorStats(metrics.StatsEnvelope, KVConnectorStats):
    """vLLM's envelope for the connector's metrics (``kvtier.connector.metrics.Stats``)."""

    data: dict[str, Any] = field(default_factory=metrics.empty)


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


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        groups, self._contents = vllmspec.engine_groups(config, vllm_config, kv_cache_config)
        specs = groups[0].specs
        self._tier = factory.connect(config, metrics.KV)
        load, save = bool(transfer.is_kv_consumer), bool(transfer.is_kv_producer)
        # Steps vLLM schedules before it sees a step's output: a failed load's step and
        # these store nothing (kv/worker.py), and are saved again (kv/scheduler.py).
        steps_ahead = max(0, int(vllm_config.max_concurrent_batches) - 1)
        self._scheduler: KvtierScheduler | None = None
        self._worker: KvtierWorker | None = None
        self._layout_name: str | None = None
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                logger.warning(
                    "kvtier: setting kv_load_failure_policy=recompute (was %r): a chunk the "
                    "tier cannot deliver is recomputed, never a failed request",
                    transfer.kv_load_failure_policy,
                )
                transfer.kv_load_failure_policy = "recompute"
            self._scheduler = KvtierScheduler(
                config, specs, self._tier.client, breaker=self._tier.breaker,
                recorder=self._tier.recorder, load=load, save=save, groups=groups,
                steps_ahead=steps_ahead,
            )  # fmt: skip
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._layout_name = kv_cache_config.kv_cache_layout
            self._worker = KvtierWorker(
                config,
                self._tier.client,
                rank=get_tensor_model_parallel_rank(),
                num_blocks=kv_cache_config.num_blocks,
                layer_order=groups[0].layer_names,
                breaker=self._tier.breaker,
                recorder=self._tier.recorder,
                groups=groups,
                steps_ahead=steps_ahead,
            )
        logger.info(
            "kvtier: %s connector for %s, tier %s, chunk %d tokens, load=%s save=%s, "
            "KV cache groups: %s",
            role.name.lower(), specs[0].model_id, config.target, config.chunk_size, load, save,
            ", ".join(f"{g.kind}{f'={g.window}' if g.window else ''} ({len(g.layer_names)} "
                      "layers)" for g in groups),
        )  # fmt: skip
        self._tier.warm_up(config, "requests recompute")

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future miss, nothing more.
        return False

    @property
    def recorder(self) -> metrics.Recorder:
        """This half's metrics (``recorder.totals()``: everything since start)."""
        return self._tier.recorder

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

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request)
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        self.scheduler.loads_failed(connector_output.failed_recving or ())
        self.scheduler.blocks_failed(getattr(connector_output, "invalid_block_ids", None) or ())

    # -- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        vllm_config = self._vllm_config
        names = [n for names in self.worker.group_layers for n in names if n in kv_caches]
        family = family_of(vllmspec.backends(vllm_config, names or list(kv_caches)))
        expected = {content.family for content in self._contents}
        if expected != {family}:
            raise ConfigError(
                f"kvtier: the attention backend stores {family!r} KV content, but kvtier keys "
                f"{' and '.join(sorted(expected))} content on this platform; choose a backend "
                "of that content with --attention-backend (kvtier.connector.kv.layouts.BACKENDS)"
            )
        layout = self._layout_name or vllm_config.cache_config.kv_cache_layout
        self.worker.register_kv_caches(
            kv_caches, order=KVOrder.named(str(layout)), content=self._contents,
            values=vllmspec.value_dtypes(vllm_config, self._contents),
        )  # fmt: skip

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.worker.save_kv_layer(layer_name, self._plan())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._plan())

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        return meta.plan

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load and save_kv_layer order copies with the forward: they must
        # run (in Python) every step, which a full CUDA graph's replay skips.
        return (extra_config or {}).get("layerwise", True) is not False

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.failed_blocks()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self.worker.finished_loads()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        self._tier.close()

    # -- metrics --------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
        data = self._tier.take_stats()
        return KvtierConnectorStats(data=data) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierConnectorStats:
        return KvtierConnectorStats.of(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
