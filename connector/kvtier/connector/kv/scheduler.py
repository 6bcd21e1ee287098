"""The scheduler half: one Lookup per request, and the per-step load/save plan.

Per request it keeps the prompt's chunk keys (multimodal spans substituted, one
chain per KV cache group and tensor-parallel rank), how many leading chunks the tier
held at lookup time (remembered across preemption: no second round trip), its KV
block ids (per group), and the next chunk to save. Each step ``build_connector_meta``
tells the workers which chunks to load into which blocks before the forward pass, and
which chunks became complete and should be saved after it.

With several KV cache groups (vLLM's hybrid KV cache manager; what each group stores
and loads: ``kvtier.connector.kv.groups``) the lookup asks for the full-attention
groups' chunks, then for the other groups' chunks the hit's end needs (two round
trips: their early chunks are never read by long hits, so they may be evicted first
without costing those hits). Their loads are ones vLLM waits for
(``get_num_new_matched_tokens`` answers ``True``): vLLM 0.32 cannot take failed blocks
from an engine with several groups, only failed requests, which it recomputes; the
request's hit is then forgotten and its chunks saved again.

Nothing here raises into vLLM: a tier error (or any bug) is a miss, logged and
counted. A request whose keys cannot be computed (malformed multimodal positions,
overlapping items, token ids out of range: ``ValueError``) is neither looked up nor
saved, and counted in ``requests_skipped{reason="bad_input"}``; an unsalted request
under ``salt_policy=required`` in ``requests_skipped{reason="no_salt"}``.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.connector.chunks.keys import KeyChain, KeySpec, MMItem, pack_token_ids
from kvtier.connector.client.breaker import CircuitBreaker
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.errors import TierError
from kvtier.connector.kv.groups import FULL, NULL_BLOCK, KVGroup
from kvtier.connector.kv.plan import ChunkLoad, ChunkSave, RequestLoad, StepPlan
from kvtier.connector.metrics import Recorder
from kvtier.connector.tiercalls import LookupTier

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    keys: list[tuple[tuple[bytes, ...], ...]]
    """Per full prompt chunk: per KV cache group, its key for each rank."""
    hit_chunks: int | None = None
    """Leading chunks the tier held at lookup time (None: not looked up yet)."""
    local_tokens: int = 0
    """Tokens vLLM had locally when it last asked (the load starts there)."""
    load_range: tuple[int, int] | None = None
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV cache group: the request's blocks (vLLM's block table)."""
    next_save: int = 0
    unfilled_from: int | None = None
    """The first token of a block of this request a load left unfilled, until vLLM is seen
    recomputing from there: no chunk from that block's on is saved meanwhile."""


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
        groups: Sequence[KVGroup] | None = None,
        steps_ahead: int = 0,
    ) -> None:
        """``specs``: the key spec of each tensor-parallel rank, for an engine with one
        full-attention KV cache group; ``groups`` (each with its specs): any engine.
        ``steps_ahead``: how many steps vLLM schedules before it has seen a step's
        output (1 with its asynchronous scheduling, else 0): the worker's too."""
        self._config = config
        self._groups = list(groups or [KVGroup(specs[0].block_size, specs=tuple(specs))])
        self._anchors = [g for g, group in enumerate(self._groups) if group.kind == FULL] or [
            *range(len(self._groups))
        ]
        self._reported = len(self._groups) > 1
        self._tier = tier
        self._breaker = breaker
        self._recorder = recorder
        self._load = load
        self._save = save
        self._chunk = config.chunk_size
        self._block = math.lcm(*(group.block_size for group in self._groups))
        self._requests: dict[str, _RequestState] = {}
        self._planned_saves: deque[list[tuple[str, int]]] = deque(maxlen=1 + steps_ahead)
        """(request, chunk) of the saves of the steps whose output vLLM has not seen yet:
        the worker drops them all when one of those steps' loads fails."""
        self._reported_loads: list[str] = []
        """Requests given a reported load by ``update_state_after_alloc`` (vLLM does not
        schedule them this step: ``build_connector_meta`` plans their loads)."""

    # -- vLLM scheduler hooks -------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        try:
            tokens = self._matched(request, num_computed_tokens)
            return tokens, self._reported and tokens > 0
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
        # The block ids come with the step (build_connector_meta), new or resumed; a
        # reported load's request is not scheduled this step: its ids come from here.
        if num_external_tokens > 0:
            state.load_range = (state.local_tokens, state.local_tokens + num_external_tokens)
            if self._reported:
                state.block_ids = [list(ids) for ids in blocks.get_block_ids()]
                self._reported_loads.append(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        plan = StepPlan()
        self._planned_saves.append([])
        for req_id in self._reported_loads:
            state = self._requests.get(req_id)
            if state is None:
                plan.failed_loads.append(req_id)  # vLLM still waits for it: answer
            else:
                self._plan(plan, req_id, state, 0)
        self._reported_loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = [list(ids) for ids in new.block_ids]
                self._recomputing(state, new.num_computed_tokens)
                self._plan(plan, new.req_id, state, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new_ids]
                for ids, added in zip(state.block_ids, new_ids, strict=True):
                    ids.extend(added)
            self._recomputing(state, cached.num_computed_tokens[i])
            self._plan(plan, req_id, state, cached.num_computed_tokens[i] + scheduled[req_id])
        return plan

    def request_finished(self, request: Any) -> None:
        self._requests.pop(request.request_id, None)

    def blocks_failed(self, block_ids: Iterable[int]) -> None:
        """Blocks a load left unfilled in the step whose output vLLM gives now (only an
        engine with one KV cache group reports blocks, vLLM 0.32).

        The worker stored none of the chunks of that step and of the steps planned since:
        they are planned again. A request holding one of the blocks saves nothing from that
        block's chunk on until vLLM is seen recomputing it from there (``_recomputing``): vLLM
        recomputes the request whose load failed, but a request that shared the block
        through vLLM's prefix cache in a step planned before vLLM saw the failure
        (asynchronous scheduling) keeps what it computed on it, and is never saved from
        there. An engine whose one group frees blocks (a sliding window) re-plans nothing:
        the block ids kvtier keeps for it may have been freed since."""
        failed = set(block_ids)
        if not failed or self._groups[0].kind != FULL:
            return
        for planned in self._planned_saves:
            for req_id, chunk in planned:
                saved = self._requests.get(req_id)
                if saved is not None:
                    saved.next_save = min(saved.next_save, chunk)
        for state in self._requests.values():
            table = state.block_ids[0] if state.block_ids else []
            first = next((i for i, b in enumerate(table) if b in failed), None)
            if first is None:
                continue
            start = first * self._groups[0].block_size
            chunk = start // self._chunk
            if state.unfilled_from is None or start < state.unfilled_from:
                state.unfilled_from = start
            if state.hit_chunks is not None:
                state.hit_chunks = min(state.hit_chunks, chunk)

    def _recomputing(self, state: _RequestState, computed: int) -> None:
        """vLLM schedules the request from ``computed`` tokens on: if that is at or before
        a block a load left unfilled, it recomputes it, and the chunks from there are saved
        again as they complete."""
        if state.unfilled_from is not None and computed <= state.unfilled_from:
            state.next_save = min(state.next_save, state.unfilled_from // self._chunk)
            state.unfilled_from = None

    def loads_failed(self, req_ids: Iterable[str]) -> None:
        """Reported loads that failed (vLLM recomputes the request from its start): forget
        their hits, and save their chunks again as they are computed."""
        for req_id in req_ids:
            state = self._requests.get(req_id)
            if state is not None:
                state.hit_chunks, state.next_save = 0, 0

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
            state.hit_chunks = self._lookup_hit(state.keys, request.num_tokens)
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
        """Hit tokens vLLM may take: block-aligned, never the last token (vLLM must
        compute at least one token to sample from), and all stored by every group (else
        the hit ends at its last whole chunk)."""
        last_block_start = (num_tokens - 1) // self._block * self._block
        end = min(hit_chunks * self._chunk, last_block_start)
        if all(group.covers(end, self._chunk) for group in self._groups):
            return end
        return end // self._chunk * self._chunk

    def _lookup_hit(self, keys: list[tuple[tuple[bytes, ...], ...]], num_tokens: int) -> int:
        """Leading chunks the tier holds for a hit: the full-attention groups' chunks
        (every group's, without one), then the other groups' chunks the hit's end needs."""
        anchors = self._anchors
        found = self._lookup([k[g][0] for k in keys for g in anchors]) // len(anchors)
        others = [g for g in range(len(self._groups)) if g not in anchors]
        if not others or not found:
            return found
        # Every end a later call may take (a preempted request has more tokens), at most
        # ``found`` chunks: the chunks from the shortest one's window on.
        first = min(
            self._groups[g].first_kept(self._usable(found, num_tokens)) for g in others
        )
        needed = [k[g][0] for k in keys[first // self._chunk : found] for g in others]
        if self._lookup(needed) == len(needed):
            return found
        return 0

    def _keys(self, request: Any) -> list[tuple[tuple[bytes, ...], ...]] | None:
        """Per full prompt chunk, per group, its key for each rank; None: the request is
        not cached. Raises ``ValueError`` when the request's data cannot be keyed."""
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
        per_group = [
            list(
                zip(
                    *(
                        KeyChain(
                            spec,
                            items,
                            cache_salt=salt,
                            lora_name=getattr(lora, "lora_name", None),
                            lora_path=getattr(lora, "lora_path", None),
                        ).extend(prompt)
                        for spec in group.specs
                    ),
                    strict=True,
                )
            )
            for group in self._groups
        ]
        return list(zip(*per_group, strict=True))

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
                first = state.next_save
                plan.saves.extend(self._save_plan(state, computed))
                self._planned_saves[-1].extend((req_id, c) for c in range(first, state.next_save))
        except Exception:
            # Never leave promised blocks unfilled: have the worker report them failed.
            logger.exception("kvtier: planning request %s failed; recomputing it", req_id)
            if load_range is not None and self._reported:
                plan.failed_loads.append(req_id)
            elif load_range is not None:
                first, last = load_range[0] // self._block, load_range[1] // self._block
                table = state.block_ids[0] if state.block_ids else []
                plan.failed_blocks.extend(table[first:last])
            state.next_save = len(state.keys)

    def _load_plan(self, req_id: str, state: _RequestState, start: int, end: int) -> RequestLoad:
        """Per chunk, per group: the blocks of ``start:end`` the group keeps (``needed``)."""
        loads = []
        for c in range(start // self._chunk, -(-end // self._chunk)):
            for g, group in enumerate(self._groups):
                per_chunk = self._chunk // group.block_size
                needed = group.needed(start, end)
                first = max(needed.start, c * per_chunk)
                last = min(needed.stop, (c + 1) * per_chunk)
                if first >= last:
                    continue
                stored = group.stored_from(c, self._chunk)
                ids = _block_ids(state.block_ids[g], first, last, group)
                loads.append(
                    ChunkLoad(state.keys[c][g], first - c * per_chunk - stored, ids, g, stored)
                )
        return RequestLoad(req_id, tuple(loads), report=self._reported)

    def _save_plan(self, state: _RequestState, computed: int) -> list[ChunkSave]:
        """Chunks completed by ``computed`` tokens that the tier does not hold yet (none
        from a block a load left unfilled on, until vLLM recomputes it)."""
        saves: list[ChunkSave] = []
        done = min(len(state.keys), computed // self._chunk)
        if state.unfilled_from is not None:
            done = min(done, state.unfilled_from // self._chunk)
        while state.next_save < done:
            c = state.next_save
            chunk = []
            for g, group in enumerate(self._groups):
                per_chunk = self._chunk // group.block_size
                stored = group.stored_from(c, self._chunk)
                first, last = c * per_chunk + stored, (c + 1) * per_chunk
                if len(state.block_ids[g]) < last:
                    return saves  # not all its blocks yet
                ids = _block_ids(state.block_ids[g], first, last, group)
                chunk.append(ChunkSave(state.keys[c][g], ids, g, stored))
            saves.extend(chunk)
            state.next_save += 1
        return saves


def _block_ids(table: list[int], first: int, last: int, group: KVGroup) -> tuple[int, ...]:
    """Blocks ``first:last`` of a group's block table: all there, and none the null block
    (where a group that frees blocks keeps none)."""
    ids = tuple(table[first:last])
    if len(ids) != last - first:
        raise ValueError(f"request has {len(table)} blocks, the plan needs {last}")
    if group.kind != FULL and NULL_BLOCK in ids:
        raise ValueError(f"blocks {first}:{last} include vLLM's null block (not kept)")
    return ids
