"""The scheduler half of the encoder cache: fetch and verify before scheduling, plan loads.

vLLM asks the scheduler-side EC connector, per request, ``ensure_cache_available``
(before it schedules the request), then per item ``has_cache_item`` (True: vLLM
does not schedule the encoder for it and expects the worker to put its output into
the encoder cache), then ``update_state_after_alloc`` for every item it allocated.
A "yes" from ``has_cache_item`` is a promise the worker must keep: vLLM fails the
step on a missing encoder output. So the scheduler says yes only for entries it
already holds, fetched and verified:

- ``ensure_cache_available``: one ``Get`` per request for the items not yet computed
  (deadline ``lookup_timeout_s``, behind the circuit breaker); every entry is
  decoded (checksum, key fingerprint, length), and its dtype and shape are checked
  against the request's placeholder. Anything else is a miss: the encoder runs.
- the verified payloads wait in a byte-bounded LRU (``HELD_BYTES``) until vLLM
  allocates the item; then they travel to the worker in the step's plan
  (``ECStepPlan.loads``), which only copies bytes into a tensor (it cannot fail).
- items vLLM will encode get their key in ``ECStepPlan.saves``: the worker saves
  the encoder output under it in the background.

This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvtier.connector.breaker import CircuitBreaker
from kvtier.connector.codec import DTYPE_SIZES, decode_chunk
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.ec_keys import EncoderKeySpec, encoder_key
from kvtier.connector.errors import ChunkDecodeError, TierError
from kvtier.connector.metrics import Recorder
from kvtier.connector.sender import SaveSender
from kvtier.connector.worker import GetTier

logger = logging.getLogger(__name__)

HELD_BYTES: Final = 512 << 20
"""Verified entries waiting for vLLM to allocate their item, at most (oldest dropped)."""


@dataclass(frozen=True)
class EncoderLoad:
    """A verified encoder output on its way to the worker's encoder cache."""

    identifier: str
    dtype: str
    shape: tuple[int, ...]
    payload: bytes


@dataclass
class ECStepPlan:
    """One step's work for the worker: loads to place, and keys to save new outputs under."""

    loads: list[EncoderLoad] = field(default_factory=list)
    saves: dict[str, bytes] = field(default_factory=dict)
    """identifier -> key, for the items vLLM encodes this step."""


class KvtierECScheduler:
    def __init__(
        self,
        config: ConnectorConfig,
        spec: EncoderKeySpec,
        tier: GetTier,
        *,
        breaker: CircuitBreaker,
        recorder: Recorder,
        load: bool,
        save: bool,
        widths: Mapping[str, int] | None = None,
        held_bytes: int = HELD_BYTES,
    ) -> None:
        self._config = config
        self._spec = spec
        self._tier = tier
        self._breaker = breaker
        self._recorder = recorder
        self._load = load
        self._save = save
        self._widths = widths if widths is not None else {}
        self._held_limit = held_bytes
        self._held: OrderedDict[str, EncoderLoad] = OrderedDict()
        self._held_bytes = 0
        self._promised: dict[str, EncoderLoad] = {}
        self._checked: set[str] = set()
        self._loads: dict[str, EncoderLoad] = {}
        self._saves: dict[str, bytes] = {}
        # Deletes of entries that failed verification, off the scheduling path.
        self._deleter = SaveSender(
            tier,
            capacity=64,
            batch=16,
            timeout_s=config.save_timeout_s,
            breaker=breaker,
            recorder=recorder,
        )

    @property
    def spec(self) -> EncoderKeySpec:
        return self._spec

    def key(self, request: Any, feature: Any) -> bytes | None:
        """The key of one item of ``request``; None when the salt policy forbids caching it."""
        salt = getattr(request, "cache_salt", None) or None
        policy = self._config.salt_policy
        if policy == "none":
            salt = None
        elif policy == "required" and salt is None:
            return None
        lora = getattr(request, "lora_request", None)
        return encoder_key(
            self._spec,
            feature.identifier,
            feature.modality,
            cache_salt=salt,
            salt=getattr(self._config, "salt", None),
            lora_name=getattr(lora, "lora_name", None),
        )

    # -- vLLM's scheduler calls ----------------------------------------------------

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        """Fetch and verify the entries of the request's items not yet computed (once per
        request). Always True: the request never waits for the tier beyond the deadline."""
        if not self._load or request.request_id in self._checked:
            return True
        self._checked.add(request.request_id)
        wanted: dict[str, tuple[bytes, int, str]] = {}
        for feature in request.mm_features:
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # its tokens are computed (prefix cache or KV connector)
            if feature.identifier in wanted or feature.identifier in self._held:
                continue
            key = self.key(request, feature)
            if key is not None:
                wanted[feature.identifier] = (key, position.get_num_embeds(), feature.modality)
        if wanted:
            self._fetch(wanted)
        return True

    def has_cache_item(self, identifier: str) -> bool:
        """True only for a verified entry in hand; from here on it cannot be evicted."""
        entry = self._held.pop(identifier, None)
        if entry is not None:
            self._held_bytes -= len(entry.payload)
            self._promised[identifier] = entry
        return identifier in self._promised

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        feature = request.mm_features[index]
        entry = self._promised.pop(feature.identifier, None)
        if entry is not None:
            self._loads[feature.identifier] = entry
            return
        if self._save:
            key = self.key(request, feature)
            if key is not None:
                self._saves[feature.identifier] = key

    def build_connector_meta(self) -> ECStepPlan:
        plan = ECStepPlan(loads=list(self._loads.values()), saves=self._saves)
        for entry in plan.loads:
            self._recorder.count("hits")
            self._recorder.count("loaded_bytes", len(entry.payload))
        # Promised but not allocated (the request could not be scheduled this step):
        # back to the evictable entries; vLLM asks again next step.
        for entry in self._promised.values():
            self._hold(entry)
        self._promised.clear()
        self._loads, self._saves = {}, {}
        return plan

    def request_finished(self, request: Any) -> None:
        self._checked.discard(request.request_id)

    def shutdown(self) -> None:
        self._deleter.close()

    # -- fetch and verify ----------------------------------------------------------

    def _fetch(self, wanted: dict[str, tuple[bytes, int, str]]) -> None:
        if not self._breaker.allow():
            self._recorder.count("calls_skipped", label="load")
            return
        keys = [key for key, _, _ in wanted.values()]
        self._recorder.count("lookups", len(keys))
        started = time.perf_counter()
        try:
            blobs: Sequence[bytes | memoryview | None] = self._tier.get(
                keys, stop_at_first_miss=False, timeout_s=self._config.lookup_timeout_s
            )
        except TierError as exc:
            self._breaker.failure()
            self._recorder.count("errors", label="load")
            logger.warning("kvtier: encoder-cache Get of %d item(s) failed (%s)", len(keys), exc)
            return
        self._breaker.success()
        for (identifier, (key, embeds, modality)), blob in zip(wanted.items(), blobs, strict=False):
            if blob is None:
                continue
            try:
                entry = self._verify(identifier, key, blob, embeds, modality)
            except ChunkDecodeError as exc:
                self._recorder.count("corrupt_chunks")
                self._deleter.delete(key)
                logger.warning("kvtier: encoder-cache entry unusable, encoding instead (%s)", exc)
                continue
            self._hold(entry)
        self._recorder.observe("load_seconds", time.perf_counter() - started)

    def _verify(
        self, identifier: str, key: bytes, blob: bytes | memoryview, embeds: int, modality: str
    ) -> EncoderLoad:
        chunk = decode_chunk(key, blob)
        if chunk.codec != "raw":
            raise ChunkDecodeError(f"encoder entries are stored raw, this one is {chunk.codec!r}")
        shape = chunk.shape
        if len(shape) < 2 or shape[0] != embeds:
            raise ChunkDecodeError(
                f"encoder output of shape {shape} does not fit the item's {embeds} embeddings"
            )
        width = self._widths.get(modality)
        if width is not None and math.prod(shape[1:]) != width:
            raise ChunkDecodeError(
                f"encoder output of shape {shape} does not have this engine's width {width}"
            )
        if chunk.payload.nbytes != math.prod(shape) * DTYPE_SIZES[chunk.dtype]:
            raise ChunkDecodeError("encoder output payload does not fit its shape")
        return EncoderLoad(identifier, chunk.dtype, shape, bytes(chunk.payload))

    def _hold(self, entry: EncoderLoad) -> None:
        old = self._held.pop(entry.identifier, None)
        if old is not None:
            self._held_bytes -= len(old.payload)
        self._held[entry.identifier] = entry
        self._held_bytes += len(entry.payload)
        while self._held_bytes > self._held_limit and len(self._held) > 1:
            _, dropped = self._held.popitem(last=False)
            self._held_bytes -= len(dropped.payload)
