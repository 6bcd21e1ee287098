"""The scheduler half of the encoder cache: fetch and verify before scheduling, plan loads.

vLLM asks the scheduler-side EC connector, per request, ``ensure_cache_available``
(before it schedules the request), then, for each item its own encoder cache does
not hold, ``has_cache_item`` (True: vLLM does not schedule the encoder for it and
expects the worker to put its output into the encoder cache), then
``update_state_after_alloc`` for every item it allocated. A "yes" from
``has_cache_item`` is a promise the worker must keep: vLLM fails the step on a
missing encoder output. So the scheduler says yes only for entries it already
holds, fetched and verified:

- ``ensure_cache_available`` (before each step of a request) notes the request's items
  not yet computed and their keys, once each; it calls nothing. An item the KV
  connector loaded is noted only if that load fails and vLLM recomputes it.
- ``has_cache_item`` fetches a noted item with one ``Get`` (deadline
  ``lookup_timeout_s``, behind the circuit breaker) the first time vLLM asks about
  it. vLLM asks only about items its own encoder cache lacks, so an image the engine
  still holds (a repeat, or another running request's) costs the tier nothing. The
  entry is decoded (checksum, key fingerprint, length), and its dtype and shape are
  checked against the item's placeholder. Anything else is a miss: the encoder runs.
  A failed fetch drops every noted item (they would fail the same way): they are
  encoded, and the step waits for at most one deadline.
- verified payloads wait in a byte-bounded LRU (``HELD_BYTES``) until vLLM
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

from kvtier.connector.chunks.codec import DTYPE_SIZES, decode_chunk
from kvtier.connector.chunks.encoder_keys import EncoderKeySpec, encoder_key
from kvtier.connector.chunks.finite import first_nonfinite
from kvtier.connector.client.breaker import CircuitBreaker
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.encoder.plan import ECStepPlan, EncoderLoad
from kvtier.connector.errors import ChunkDecodeError, TierError
from kvtier.connector.metrics import Recorder
from kvtier.connector.sender import SaveSender
from kvtier.connector.tiercalls import GetTier

logger = logging.getLogger(__name__)

HELD_BYTES: Final = 512 << 20
"""Verified entries waiting for vLLM to allocate their item, at most (oldest dropped)."""


@dataclass
class _Noted:
    """An item a live request may need: its placeholder's embedding count and modality,
    and the requests that noted it under this key."""

    embeds: int
    modality: str
    requests: set[str] = field(default_factory=set)


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
        # Items live requests noted, by identifier then key (a cache salt changes the
        # key of the same item), fetched when vLLM first asks about the identifier.
        self._noted: dict[str, dict[bytes, _Noted]] = {}
        self._noted_by: dict[str, list[tuple[str, bytes]]] = {}  # request id -> its notes
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
        """Note the request's items not yet computed; nothing is fetched until vLLM asks
        about an item. vLLM calls this before every step of a request, and an item can
        become uncomputed again: when a KV load fails, vLLM recomputes from the first
        failed block, items inside it included, and vLLM 0.32 has dropped the data of
        items its connector tokens covered (``strip_covered_mm_data``), so their encoder
        output must come from the tier. Always True: the request never waits."""
        if not self._load:
            return True
        notes = self._noted_by.setdefault(request.request_id, [])
        for feature in request.mm_features:
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # its tokens are computed (prefix cache or KV connector)
            if any(identifier == feature.identifier for identifier, _ in notes):
                continue
            key = self.key(request, feature)
            if key is None:
                continue
            by_key = self._noted.setdefault(feature.identifier, {})
            noted = by_key.get(key)
            if noted is None:
                noted = by_key[key] = _Noted(position.get_num_embeds(), feature.modality)
            noted.requests.add(request.request_id)
            notes.append((feature.identifier, key))
        return True

    def has_cache_item(self, identifier: str) -> bool:
        """True only for a verified entry in hand; from here on it cannot be evicted.
        vLLM asks only about items its own encoder cache does not hold: the first
        question about a noted item fetches it."""
        if identifier not in self._held and identifier not in self._promised:
            noted = self._noted.pop(identifier, None)
            if noted:
                self._fetch(identifier, noted)
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
        for identifier, key in self._noted_by.pop(request.request_id, ()):
            by_key = self._noted.get(identifier)
            noted = by_key.get(key) if by_key is not None else None
            if by_key is None or noted is None:
                continue  # fetched already
            noted.requests.discard(request.request_id)
            if not noted.requests:
                del by_key[key]
                if not by_key:
                    del self._noted[identifier]

    def shutdown(self) -> None:
        self._deleter.close()

    # -- fetch and verify ----------------------------------------------------------

    def _fetch(self, identifier: str, noted: dict[bytes, _Noted]) -> None:
        """One Get for an item (under each key live requests noted it with); the first
        entry that verifies is held."""
        if not self._breaker.allow():
            self._recorder.count("calls_skipped", label="load")
            return
        keys = list(noted)
        self._recorder.count("lookups", len(keys))
        started = time.perf_counter()
        try:
            blobs: Sequence[bytes | memoryview | None] = self._tier.get(
                keys, stop_at_first_miss=False, timeout_s=self._config.lookup_timeout_s
            )
        except TierError as exc:
            self._breaker.failure()
            self._recorder.count("errors", label="load")
            dropped = len(self._noted)
            self._noted.clear()  # they would wait for the same tier: encode them
            logger.warning(
                "kvtier: encoder-cache Get failed (%s); encoding this item and %d other "
                "noted item(s)",
                exc,
                dropped,
            )
            return
        self._breaker.success()
        for key, blob in zip(keys, blobs, strict=False):
            if blob is None:
                continue
            try:
                entry = self._verify(identifier, key, blob, noted[key].embeds, noted[key].modality)
            except ChunkDecodeError as exc:
                self._recorder.count("corrupt_chunks")
                self._deleter.delete(key)
                logger.warning("kvtier: encoder-cache entry unusable, encoding instead (%s)", exc)
                continue
            self._hold(entry)
            break
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
        if (found := first_nonfinite(chunk.payload, chunk.dtype)) >= 0:
            raise ChunkDecodeError(
                f"encoder output holds a NaN or an infinity ({chunk.dtype} element {found})", "nonfinite"
            )
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
