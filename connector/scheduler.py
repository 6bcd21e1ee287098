"""The scheduler half: one Lookup per request, and the per-step load/save plan.

Per request it keeps the prompt's chunk keys (multimodal spans substituted, one
chain per tensor-parallel rank), how many leading chunks the tier held at lookup
time (remembered across preemption: no second round trip), its KV block ids,
and the next chunk to save. Each step ``build_connector_meta`` tells the workers
which chunks to load into which blocks before the forward pass, and which chunks
became complete and should be saved after it.

Nothing here raises into vLLM: a tier error (or any bug) is a miss, logged and
counted. A request whose keys cannot be computed (malformed multimodal positions,
overlapping items, token ids out of range: ``ValueError``) is neither looked up nor
saved, and counted in ``requests_skipped{reason="bad_input"}``; an unsalted request
under ``salt_policy=required`` in ``requests_skipped{reason="no_salt"}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.connector.breaker import CircuitBreaker
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.errors import TierError
from kvtier.connector.keys import KeyChain, KeySpec, MMItem, pack_token_ids
from kvtier.connector.metadata import ChunkLoad, ChunkSave, RequestLoad, StepPlan
from kvtier.connector.metrics import Recorder

logger = logging.getLogger(__name__)


class LookupTier(Protocol):
    def lookup(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int: ...


@dataclass
class _RequestState:
    keys: list[tuple[bytes, ...]]
    """Per full prompt chunk: its key for each rank."""
    hit_chunks: int | None = None
    """Leading chunks the tier held at lookup time (None: not looked up yet)."""
    local_tokens: int = 0
    """Tokens vLLM had locally when it last asked (the load starts there)."""
    load_range: tuple[int, int] | None = None
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0


class KvtierScheduler:
    def __init__(
        self,
        config: ConnectorConfig,
        specs: Sequence[KeySpec],
        tier: LookupTier,
        *,
        breaker: CircuitBreaker,
        recorder: Recorder,
        load: bool = True,
        save: bool = True,
    ) -> None:
        self._config = config
        self._specs = list(specs)
        self._tier = tier
        self._breaker = breaker
        self._recorder = recorder
        self._load = load
        self._save = save
        self._chunk = config.chunk_size
        self._block = specs[0].block_size
        self._requests: dict[str, _RequestState] = {}

    # -- vLLM scheduler hooks -------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        try:
            return self._matched(request, num_computed_tokens), False
        except Exception:
            logger.exception(
                "kvtier: lookup for request %s failed; recomputing", request.request_id
            )
            self._requests.pop(request.request_id, None)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        # The block ids come with the step (build_connector_meta), new or resumed.
        if num_external_tokens > 0:
            state.load_range = (state.local_tokens, state.local_tokens + num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        plan = StepPlan()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan(plan, new.req_id, state, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._plan(plan, req_id, state, cached.num_computed_tokens[i] + scheduled[req_id])
        return plan

    def request_finished(self, request: Any) -> None:
        self._requests.pop(request.request_id, None)

    # -- internals -------------------------------------------------------------------

    def _matched(self, request: Any, num_computed_tokens: int) -> int:
        state = self._requests.get(request.request_id)
        if state is None:
            try:
                keys = self._keys(request)
            except ValueError as exc:
                # Bad input for this request only: it computes, the others go on.
                logger.warning(
                    "kvtier: request %s cannot be keyed (%s); computing it without the tier",
                    request.request_id,
                    exc,
                )
                self._recorder.count("requests_skipped", label="bad_input")
                keys = None
            if keys is None:
                # Remembered, so a rescheduled request is not judged (or counted) twice.
                self._requests[request.request_id] = _RequestState([], hit_chunks=0)
                return 0
            state = self._requests[request.request_id] = _RequestState(keys)
        state.local_tokens = num_computed_tokens
        if state.hit_chunks is None:
            state.hit_chunks = self._lookup([k[0] for k in state.keys])
            state.next_save = state.hit_chunks
            hit = self._usable(state.hit_chunks, request.num_tokens)
            self._recorder.count(
                "requested_tokens", max(0, request.num_tokens - num_computed_tokens)
            )
            self._recorder.count("hit_tokens", max(0, hit - num_computed_tokens))
        if not self._load:
            return 0
        return max(0, self._usable(state.hit_chunks, request.num_tokens) - num_computed_tokens)

    def _usable(self, hit_chunks: int, num_tokens: int) -> int:
        """Hit tokens vLLM may take: block-aligned, and never the last token (vLLM
        must compute at least one token to sample from)."""
        last_block_start = (num_tokens - 1) // self._block * self._block
        return min(hit_chunks * self._chunk, last_block_start)

    def _keys(self, request: Any) -> list[tuple[bytes, ...]] | None:
        """Per full prompt chunk, its key for each rank; None: the request is not cached.
        Raises ``ValueError`` when the request's data cannot be keyed."""
        salt = getattr(request, "cache_salt", None) or None
        policy = self._config.salt_policy
        if policy == "none":
            salt = None
        elif policy == "required" and salt is None:
            self._recorder.count("requests_skipped", label="no_salt")
            return None
        prompt = request.prompt_token_ids
        if not prompt or len(prompt) < self._chunk:
            return []
        items = [
            MMItem(f.identifier or f.mm_hash, f.mm_position.offset, f.mm_position.length)
            for f in (getattr(request, "mm_features", None) or ())
        ]
        lora = getattr(request, "lora_request", None)
        prompt = pack_token_ids(prompt)  # once per request, not once per rank
        chains = [
            KeyChain(
                spec,
                items,
                cache_salt=salt,
                lora_name=getattr(lora, "lora_name", None),
                lora_path=getattr(lora, "lora_path", None),
            ).extend(prompt)
            for spec in self._specs
        ]
        return list(zip(*chains, strict=True))

    def _lookup(self, keys: list[bytes]) -> int:
        if not keys:
            return 0
        if not self._breaker.allow():
            self._recorder.count("calls_skipped", label="lookup")
            return 0
        started = time.perf_counter()
        try:
            found = self._tier.lookup(keys, timeout_s=self._config.lookup_timeout_s)
        except TierError as exc:
            self._breaker.failure()
            self._recorder.count("errors", label="lookup")
            logger.warning("kvtier: Lookup failed (%s); recomputing", exc)
            return 0
        self._breaker.success()
        found = max(0, min(found, len(keys)))
        self._recorder.count("lookups")
        self._recorder.count("lookup_chunks", len(keys))
        self._recorder.count("lookup_hit_chunks", found)
        self._recorder.observe("lookup_seconds", time.perf_counter() - started)
        return found

    def _plan(self, plan: StepPlan, req_id: str, state: _RequestState, computed: int) -> None:
        """Add this step's load (if one was promised) and newly completed saves."""
        load_range, state.load_range = state.load_range, None
        try:
            if load_range is not None:
                plan.loads.append(self._load_plan(req_id, state, *load_range))
            if self._save:
                plan.saves.extend(self._save_plan(state, computed))
        except Exception:
            # Never leave promised blocks unfilled: have the worker report them failed.
            logger.exception("kvtier: planning request %s failed; recomputing it", req_id)
            if load_range is not None:
                first, last = load_range[0] // self._block, load_range[1] // self._block
                plan.failed_blocks.extend(state.block_ids[first:last])
            state.next_save = len(state.keys)

    def _load_plan(self, req_id: str, state: _RequestState, start: int, end: int) -> RequestLoad:
        chunk, block = self._chunk, self._block
        per_chunk = chunk // block
        loads = []
        for c in range(start // chunk, -(-end // chunk)):
            first = max(start, c * chunk) // block
            last = min(end, (c + 1) * chunk) // block
            ids = tuple(state.block_ids[first:last])
            if len(ids) != last - first:
                raise ValueError(f"request has {len(state.block_ids)} blocks, load needs {last}")
            loads.append(ChunkLoad(state.keys[c], first - c * per_chunk, ids))
        return RequestLoad(req_id, tuple(loads))

    def _save_plan(self, state: _RequestState, computed: int) -> list[ChunkSave]:
        """Chunks completed by ``computed`` tokens that the tier does not hold yet."""
        per_chunk = self._chunk // self._block
        saves = []
        done = min(len(state.keys), computed // self._chunk)
        while state.next_save < done:
            c = state.next_save
            ids = state.block_ids[c * per_chunk : (c + 1) * per_chunk]
            if len(ids) < per_chunk:
                break
            saves.append(ChunkSave(state.keys[c], tuple(ids)))
            state.next_save += 1
        return saves
