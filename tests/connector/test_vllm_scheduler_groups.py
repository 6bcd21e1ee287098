"""The scheduler half with several KV cache groups (vLLM's hybrid KV cache manager).

A Gemma-3-like engine: group 0 sliding-window attention, group 1 full attention, both
with blocks of 128 tokens, chunks of 256. Requests and scheduler outputs are plain
namespaces with the attributes vLLM 0.32 gives them (per-group block ids, vLLM's null
block 0 where a sliding-window group keeps no block); tests/recipes runs real vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from kvtier.connector.chunks.keys import KeySpec
from kvtier.connector.client.breaker import CircuitBreaker
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.kv.groups import FULL, SLIDING_WINDOW, KVGroup
from kvtier.connector.kv.plan import ChunkLoad, RequestLoad, StepPlan
from kvtier.connector.kv.scheduler import KvtierScheduler
from kvtier.connector.metrics import Recorder
from tests.connector.test_vllm_scheduler import request

BLOCK, CHUNK = 128, 256
SWA, FULL_ATTENTION = 0, 1


class KeyTier:
    """A tier holding a set of keys; Lookup answers how many leading keys it holds."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.lookups: list[list[bytes]] = []

    def lookup(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        self.lookups.append(list(keys))
        found = 0
        while found < len(keys) and keys[found] in self.held:
            found += 1
        return found


def groups(window: int = 512) -> list[KVGroup]:
    def spec(layout: str) -> tuple[KeySpec, ...]:
        return (KeySpec("m", kv_layout=layout, block_size=BLOCK, chunk_size=CHUNK),)

    sliding = f"0/2 sliding_window={window}"
    return [
        KVGroup(BLOCK, SLIDING_WINDOW, window, tag=sliding, specs=spec(sliding)),
        KVGroup(BLOCK, FULL, tag="1/2 full", specs=spec("1/2 full")),
    ]


def make(tier: KeyTier, window: int = 512) -> tuple[KvtierScheduler, Recorder]:
    cfg = ConnectorConfig.from_extra_config({"target": "h:1", "chunk_size": CHUNK})
    recorder = Recorder()
    breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown_s)
    hybrid = groups(window)
    scheduler = KvtierScheduler(
        cfg, hybrid[0].specs, tier, breaker=breaker, recorder=recorder, groups=hybrid
    )
    return scheduler, recorder


def store(tier: KeyTier, scheduler: KvtierScheduler, req: Any, chunks: range, group: int) -> None:
    """Put the keys of ``chunks`` of ``group`` into the tier."""
    keys = scheduler._keys(req)
    assert keys is not None
    tier.held.update(keys[c][group][0] for c in chunks)


def blocks(*per_group: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: tuple(per_group))


def no_step() -> Any:
    """A scheduler output with nothing scheduled (a reported load's request waits)."""
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={},
    )


def new_step(req: Any, per_group: tuple[list[int], ...], computed: int, scheduled: int) -> Any:
    out = no_step()
    out.scheduled_new_reqs = [
        SimpleNamespace(req_id=req.request_id, block_ids=per_group, num_computed_tokens=computed)
    ]
    out.num_scheduled_tokens = {req.request_id: scheduled}
    return out


def chunk_blocks(load: Any, group: int) -> list[tuple[int, tuple[int, ...], int]]:
    return [(c.first_block, c.block_ids, c.stored_from) for c in load.chunks if c.group == group]


def test_a_hybrid_engine_keys_each_group_apart() -> None:
    tier = KeyTier()
    scheduler, _ = make(tier)
    keys = scheduler._keys(request(1000))
    assert keys is not None and len(keys) == 3
    sliding, full = {k[SWA][0] for k in keys}, {k[FULL_ATTENTION][0] for k in keys}
    assert len(sliding | full) == 6


def test_a_hit_is_a_load_vllm_waits_for_and_looks_up_the_full_group_then_the_window() -> None:
    tier = KeyTier()
    scheduler, recorder = make(tier)
    req = request(1300)  # 5 full chunks
    store(tier, scheduler, req, range(5), FULL_ATTENTION)
    store(tier, scheduler, req, range(5), SWA)

    assert scheduler.get_num_new_matched_tokens(req, 0) == (1280, True)

    full_lookup, window_lookup = tier.lookups
    keys = scheduler._keys(req)
    assert keys is not None
    assert full_lookup == [k[FULL_ATTENTION][0] for k in keys]
    # A hit of 1280 tokens keeps tokens 769.. of the sliding window: chunks 3 and 4.
    assert window_lookup == [k[SWA][0] for k in keys[3:5]]
    assert recorder.total("lookups") == 2


def test_early_sliding_window_chunks_evicted_do_not_cost_a_long_hit() -> None:
    tier = KeyTier()
    scheduler, _ = make(tier)
    req = request(1300)
    store(tier, scheduler, req, range(5), FULL_ATTENTION)
    store(tier, scheduler, req, range(3, 5), SWA)  # chunks 0..2 of the window group gone
    assert scheduler.get_num_new_matched_tokens(req, 0) == (1280, True)


def test_a_missing_chunk_of_the_hits_window_is_a_miss() -> None:
    tier = KeyTier()
    scheduler, _ = make(tier)
    req = request(1300)
    store(tier, scheduler, req, range(5), FULL_ATTENTION)
    store(tier, scheduler, req, range(4), SWA)  # chunk 4's window blocks missing
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)


def test_the_load_fills_every_full_block_and_only_the_windows_blocks() -> None:
    tier = KeyTier()
    scheduler, _ = make(tier)
    req = request(1300)  # 11 blocks
    store(tier, scheduler, req, range(5), FULL_ATTENTION)
    store(tier, scheduler, req, range(5), SWA)
    ext, _ = scheduler.get_num_new_matched_tokens(req, 0)
    full_ids = list(range(100, 111))
    window_ids = [0] * 6 + list(range(206, 211))  # vLLM's null block before the window

    scheduler.update_state_after_alloc(req, blocks(window_ids, full_ids), ext)
    plan = scheduler.build_connector_meta(no_step())

    (load,) = plan.loads
    assert load.report and load.req_id == req.request_id
    assert chunk_blocks(load, FULL_ATTENTION) == [
        (0, (100 + 2 * c, 101 + 2 * c), 0) for c in range(5)
    ]
    # Tokens 769..1279 are blocks 6..9, in chunks 3 and 4 (each stores all its blocks).
    assert chunk_blocks(load, SWA) == [(0, (206, 207), 0), (0, (208, 209), 0)]
    assert plan.saves == []


def test_a_local_hit_past_the_window_loads_only_the_rest_of_the_window() -> None:
    tier = KeyTier()
    scheduler, _ = make(tier)
    req = request(1300)
    store(tier, scheduler, req, range(5), FULL_ATTENTION)
    store(tier, scheduler, req, range(5), SWA)
    ext, _ = scheduler.get_num_new_matched_tokens(req, 1024)  # vLLM holds 8 blocks
    assert ext == 256
    window_ids = [0] * 6 + list(range(206, 211))
    scheduler.update_state_after_alloc(req, blocks(window_ids, list(range(100, 111))), ext)

    (load,) = scheduler.build_connector_meta(no_step()).loads

    assert chunk_blocks(load, FULL_ATTENTION) == [(0, (108, 109), 0)]
    assert chunk_blocks(load, SWA) == [(0, (208, 209), 0)]


def test_a_window_shorter_than_a_chunk_saves_and_loads_only_chunk_tails() -> None:
    tier = KeyTier()
    scheduler, _ = make(tier, window=128)
    req = request(1000)  # 3 chunks, 8 blocks
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    per_group = (list(range(10, 18)), list(range(20, 28)))
    saves = scheduler.build_connector_meta(new_step(req, per_group, 0, 1000)).saves
    assert [(s.group, s.block_ids, s.stored_from) for s in saves] == [
        (SWA, (11,), 1),
        (FULL_ATTENTION, (20, 21), 0),
        (SWA, (13,), 1),
        (FULL_ATTENTION, (22, 23), 0),
        (SWA, (15,), 1),
        (FULL_ATTENTION, (24, 25), 0),
    ]
    scheduler.request_finished(req)

    store(tier, scheduler, req, range(3), FULL_ATTENTION)
    store(tier, scheduler, req, range(3), SWA)
    again = request(1000, "again")
    assert scheduler.get_num_new_matched_tokens(again, 0) == (768, True)
    scheduler.update_state_after_alloc(again, blocks([0] * 5 + [35, 36, 37], per_group[1]), 768)
    (load,) = scheduler.build_connector_meta(no_step()).loads
    assert chunk_blocks(load, SWA) == [(0, (35,), 1)]  # tokens 641..767: block 5


def test_a_hit_ending_inside_a_chunk_the_window_did_not_store_ends_at_the_chunk_before() -> None:
    tier = KeyTier()
    scheduler, _ = make(tier, window=128)
    req = request(768)  # 3 chunks; vLLM computes the last block: a hit of 640 at most
    store(tier, scheduler, req, range(3), FULL_ATTENTION)
    store(tier, scheduler, req, range(3), SWA)
    # 640 would need block 4 of the window group, which chunk 2 does not store.
    assert scheduler.get_num_new_matched_tokens(req, 0) == (512, True)


def test_a_null_block_where_a_load_must_write_fails_the_load_not_the_engine() -> None:
    tier = KeyTier()
    scheduler, _ = make(tier)
    req = request(1300)
    store(tier, scheduler, req, range(5), FULL_ATTENTION)
    store(tier, scheduler, req, range(5), SWA)
    ext, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, blocks([0] * 11, list(range(100, 111))), ext)

    plan = scheduler.build_connector_meta(no_step())

    assert plan.loads == [] and plan.failed_loads == [req.request_id]
    assert plan.failed_blocks == []  # vLLM 0.32 refuses failed blocks with several groups


def test_a_failed_load_forgets_the_hit_and_saves_the_request_again() -> None:
    tier = KeyTier()
    scheduler, _ = make(tier)
    req = request(1300)
    store(tier, scheduler, req, range(5), FULL_ATTENTION)
    store(tier, scheduler, req, range(5), SWA)
    ext, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, blocks([0] * 6 + [1] * 5, [2] * 11), ext)
    scheduler.build_connector_meta(no_step())

    scheduler.loads_failed([req.request_id])  # vLLM recomputes it from token 0

    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    per_group = (list(range(10, 21)), list(range(30, 41)))
    saves = scheduler.build_connector_meta(new_step(req, per_group, 0, 1300)).saves
    assert len(saves) == 2 * 5
    assert len(tier.lookups) == 2  # no second lookup


def test_a_request_finished_before_its_load_was_planned_is_still_answered() -> None:
    tier = KeyTier()
    scheduler, _ = make(tier)
    req = request(1300)
    store(tier, scheduler, req, range(5), FULL_ATTENTION)
    store(tier, scheduler, req, range(5), SWA)
    ext, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, blocks([0] * 6 + [1] * 5, [2] * 11), ext)
    scheduler.request_finished(req)
    assert scheduler.build_connector_meta(no_step()).failed_loads == [req.request_id]


def test_a_plan_with_groups_pickles() -> None:
    import pickle

    load = ChunkLoad((b"k",), 0, (5,), group=1, stored_from=1)
    plan = StepPlan(loads=[RequestLoad("r", (load,), report=True)], failed_loads=["r"])
    assert pickle.loads(pickle.dumps(plan)) == plan
