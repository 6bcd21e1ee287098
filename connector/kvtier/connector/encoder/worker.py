"""The worker half of the encoder cache: place verified loads, save new outputs in the background.

Loads were fetched and verified by the scheduler half (``encoder.scheduler``); here they
only become tensors in vLLM's encoder cache, before the step gathers its
multimodal embeddings. A new encoder output is copied to host memory, encoded as a
kvtier chunk (``codec.encode_chunk``: header with key fingerprint and checksum) and
handed to the background sender (bounded queue; full queue or open breaker: the
save is dropped and counted, the engine never waits).
"""

from __future__ import annotations

import logging

import torch

from kvtier.connector.chunks.codec import DTYPE_SIZES, encode_chunk
from kvtier.connector.client.breaker import CircuitBreaker
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.encoder.plan import ECStepPlan, EncoderLoad
from kvtier.connector.errors import NonFiniteChunk
from kvtier.connector.metrics import Recorder
from kvtier.connector.sender import SaveSender, refuse_nonfinite
from kvtier.connector.tiercalls import PutTier

logger = logging.getLogger(__name__)


class KvtierECWorker:
    def __init__(
        self,
        config: ConnectorConfig,
        tier: PutTier,
        *,
        device: str,
        breaker: CircuitBreaker,
        recorder: Recorder,
        save: bool = True,
    ) -> None:
        """``save``: whether this worker saves new outputs (tensor-parallel rank 0 only)."""
        self._device = device
        self._save = save
        self._recorder = recorder
        self.sender = SaveSender.for_saves(tier, config, breaker=breaker, recorder=recorder)

    def load(self, plan: ECStepPlan, encoder_cache: dict[str, torch.Tensor]) -> None:
        for entry in plan.loads:
            if entry.identifier not in encoder_cache:
                encoder_cache[entry.identifier] = self._tensor(entry)

    def save(
        self, plan: ECStepPlan, encoder_cache: dict[str, torch.Tensor], identifier: str
    ) -> None:
        key = plan.saves.get(identifier)
        output = encoder_cache.get(identifier)
        if key is None or output is None or not self._save:
            return
        if not self.sender.has_room():
            self._recorder.count("saves_dropped", label="queue_full")
            return
        dtype = str(output.dtype).removeprefix("torch.")
        if dtype not in DTYPE_SIZES:
            self._recorder.count("saves_dropped", label="unsupported")
            logger.debug("kvtier: encoder outputs of dtype %s are not cached", dtype)
            return
        host = output.detach().to("cpu", copy=True).contiguous()
        payload = host.reshape(-1).view(torch.uint8).numpy()
        try:
            parts = encode_chunk(key, payload, dtype=dtype, shape=tuple(host.shape), check_finite=True)
        except NonFiniteChunk as exc:
            refuse_nonfinite(self._recorder, exc)
            return
        self.sender.offer(key, parts, payload.nbytes)

    def shutdown(self) -> None:
        self.sender.close()

    def _tensor(self, entry: EncoderLoad) -> torch.Tensor:
        dtype = getattr(torch, entry.dtype)
        flat = torch.frombuffer(bytearray(entry.payload), dtype=torch.uint8)
        return flat.view(dtype).reshape(entry.shape).to(self._device)
