"""The connector's scheduler half and background sender against a fake tier.

Requests and scheduler outputs are plain namespaces with the attributes vLLM 0.32
gives them; the real engine runs in tests/e2e.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.connector.chunks.keys import KeySpec
from kvtier.connector.client.breaker import CircuitBreaker
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.errors import TierUnavailable
from kvtier.connector.kv.groups import SLIDING_WINDOW, KVGroup
from kvtier.connector.kv.plan import StepPlan
from kvtier.connector.kv.scheduler import KvtierScheduler
from kvtier.connector.metrics import Recorder
from kvtier.connector.sender import SaveSender

BLOCK, CHUNK = 128, 256


class FakeTier:
    def __init__(self, held: int = 0, fail: bool = False) -> None:
        self.held = held
        self.fail = fail
        self.lookups: list[list[bytes]] = []

    def lookup(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        self.lookups.append(list(keys))
        if self.fail:
            raise TierUnavailable("down")
        return min(self.held, len(keys))


def make_scheduler(
    tier: FakeTier, steps_ahead: int = 0, **config: Any
) -> tuple[KvtierScheduler, Recorder]:
    cfg = ConnectorConfig.from_extra_config({"target": "h:1", "chunk_size": CHUNK, **config})
    recorder = Recorder()
    spec = KeySpec(model_id="m", block_size=BLOCK, chunk_size=CHUNK)
    breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown_s)
    scheduler = KvtierScheduler(
        cfg, [spec], tier, breaker=breaker, recorder=recorder, steps_ahead=steps_ahead
    )
    return scheduler, recorder


def request(n: int, req_id: str = "r", salt: str | None = None, mm: Any = ()) -> Any:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(range(n)),
        num_tokens=n,
        mm_features=list(mm),
        cache_salt=salt,
        lora_request=None,
    )


def blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def step(new: list[tuple[Any, list[int], int, int]]) -> Any:
    """A scheduler output with new requests: (request, block_ids, computed, scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r.request_id, block_ids=(ids,), num_computed_tokens=c)
            for r, ids, c, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={r.request_id: s for r, _, _, s in new},
    )


def cached_step(reqs: dict[str, tuple[int, int]]) -> Any:
    """A scheduler output of running requests: req_id -> (computed, scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(reqs),
            resumed_req_ids=set(),
            new_block_ids=[None] * len(reqs),
            num_computed_tokens=[c for c, _ in reqs.values()],
        ),
        num_scheduled_tokens={r: s for r, (_, s) in reqs.items()},
    )


def test_hit_is_whole_chunks_and_one_lookup() -> None:
    tier = FakeTier(held=2)
    scheduler, recorder = make_scheduler(tier)
    req = request(1000)  # 3 full chunks
    assert scheduler.get_num_new_matched_tokens(req, 0) == (512, False)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (512, False)
    assert len(tier.lookups) == 1 and len(tier.lookups[0]) == 3
    assert recorder.total("hit_tokens") == 512


def test_lookup_counts_the_chunks_asked_and_the_leading_chunks_found() -> None:
    scheduler, recorder = make_scheduler(FakeTier(held=2))
    scheduler.get_num_new_matched_tokens(request(1000), 0)  # 3 full chunks, 2 held
    assert (recorder.total("lookup_chunks"), recorder.total("lookup_hit_chunks")) == (3, 2)


def test_a_failed_lookup_counts_no_chunks() -> None:
    scheduler, recorder = make_scheduler(FakeTier(fail=True))
    scheduler.get_num_new_matched_tokens(request(1000), 0)
    assert (recorder.total("lookup_chunks"), recorder.total("lookup_hit_chunks")) == (0, 0)


def test_full_hit_leaves_the_last_block_to_compute() -> None:
    scheduler, _ = make_scheduler(FakeTier(held=2))
    assert scheduler.get_num_new_matched_tokens(request(512), 0) == (384, False)


def test_hit_beyond_local_prefix_cache_counts_only_new_tokens() -> None:
    scheduler, _ = make_scheduler(FakeTier(held=3))
    assert scheduler.get_num_new_matched_tokens(request(1000), 384) == (768 - 384, False)


def test_prompt_shorter_than_a_chunk_is_not_looked_up() -> None:
    tier = FakeTier(held=5)
    scheduler, _ = make_scheduler(tier)
    assert scheduler.get_num_new_matched_tokens(request(200), 0) == (0, False)
    assert tier.lookups == []


def test_tier_error_is_a_miss_and_counted() -> None:
    scheduler, recorder = make_scheduler(FakeTier(fail=True))
    assert scheduler.get_num_new_matched_tokens(request(1000), 0) == (0, False)
    assert recorder.total("errors", "lookup") == 1


def test_open_breaker_skips_the_lookup() -> None:
    tier = FakeTier(fail=True)
    scheduler, recorder = make_scheduler(tier, breaker_failures=1, breaker_cooldown_s=60)
    scheduler.get_num_new_matched_tokens(request(1000, "a"), 0)
    scheduler.get_num_new_matched_tokens(request(1000, "b"), 0)
    assert len(tier.lookups) == 1
    assert recorder.total("calls_skipped", "lookup") == 1


def test_required_salt_policy_ignores_unsalted_requests() -> None:
    tier = FakeTier(held=3)
    scheduler, _ = make_scheduler(tier, salt_policy="required")
    assert scheduler.get_num_new_matched_tokens(request(1000), 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(request(1000, "s", salt="t1"), 0)[0] == 768
    assert len(tier.lookups) == 1


def test_salt_changes_keys_unless_policy_is_none() -> None:
    keys = {}
    for policy in ("request", "none"):
        for salt in (None, "tenant-a"):
            tier = FakeTier()
            scheduler, _ = make_scheduler(tier, salt_policy=policy)
            scheduler.get_num_new_matched_tokens(request(600, salt=salt), 0)
            keys[policy, salt] = tier.lookups[0]
    assert keys["request", None] != keys["request", "tenant-a"]
    assert keys["none", None] == keys["none", "tenant-a"] == keys["request", None]


def test_image_changes_keys_from_its_chunk_on() -> None:
    def mm(identifier: str) -> Any:
        return SimpleNamespace(
            identifier=identifier,
            mm_hash=identifier,
            mm_position=SimpleNamespace(offset=300, length=64),
        )

    found = []
    for identifier in ("img-a", "img-b"):
        tier = FakeTier()
        scheduler, _ = make_scheduler(tier)
        scheduler.get_num_new_matched_tokens(request(1000, mm=[mm(identifier)]), 0)
        found.append(tier.lookups[0])
    a, b = found
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]


def test_plan_loads_hit_blocks_and_saves_new_chunks() -> None:
    scheduler, _ = make_scheduler(FakeTier(held=1))
    req = request(1000)
    ext, _ = scheduler.get_num_new_matched_tokens(req, 0)
    assert ext == 256
    ids = list(range(10, 18))  # 8 blocks of 128 for 1000 tokens
    scheduler.update_state_after_alloc(req, blocks(ids), ext)

    meta = scheduler.build_connector_meta(step([(req, ids, 256, 1000 - 256)]))

    (load,) = meta.loads
    assert [(c.first_block, c.block_ids) for c in load.chunks] == [(0, (10, 11))]
    assert [s.block_ids for s in meta.saves] == [(12, 13), (14, 15)]  # chunks 1 and 2


def test_plan_loads_only_blocks_past_local_prefix_cache() -> None:
    scheduler, _ = make_scheduler(FakeTier(held=3))
    req = request(1000)
    ext, _ = scheduler.get_num_new_matched_tokens(req, 384)  # 3 blocks cached locally
    ids = list(range(20, 28))
    scheduler.update_state_after_alloc(req, blocks(ids), ext)

    meta = scheduler.build_connector_meta(step([(req, ids, 768, 1000 - 768)]))

    assert [(c.first_block, c.block_ids) for c in meta.loads[0].chunks] == [
        (1, (23,)),
        (0, (24, 25)),
    ]
    assert meta.saves == []  # the tier holds all 3 chunks


def test_chunked_prefill_saves_each_chunk_once_when_complete() -> None:
    scheduler, _ = make_scheduler(FakeTier())
    req = request(1000)
    scheduler.get_num_new_matched_tokens(req, 0)
    ids = list(range(8))
    scheduler.update_state_after_alloc(req, blocks(ids), 0)
    first = scheduler.build_connector_meta(step([(req, ids, 0, 300)]))
    second = scheduler.build_connector_meta(cached_step({"r": (300, 700)}))
    assert [s.block_ids for s in first.saves] == [(0, 1)]
    assert [s.block_ids for s in second.saves] == [(2, 3), (4, 5)]


def test_preempted_request_reloads_into_new_blocks_without_a_second_lookup() -> None:
    tier = FakeTier(held=2)
    scheduler, _ = make_scheduler(tier)
    req = request(1000)
    ext, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, blocks(list(range(8))), ext)
    scheduler.build_connector_meta(step([(req, list(range(8)), 512, 488)]))
    # preempted: blocks freed; rescheduled later with other blocks
    ext_again, _ = scheduler.get_num_new_matched_tokens(req, 0)
    new_ids = list(range(30, 38))
    scheduler.update_state_after_alloc(req, blocks(new_ids), ext_again)
    resumed = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["r"],
            resumed_req_ids={"r"},
            new_block_ids=[(new_ids,)],
            num_computed_tokens=[512],
        ),
        num_scheduled_tokens={"r": 488},
    )

    plan = scheduler.build_connector_meta(resumed)

    assert ext_again == 512 and len(tier.lookups) == 1
    assert [c.block_ids for c in plan.loads[0].chunks] == [(30, 31), (32, 33)]
    assert plan.saves == []  # chunk 2 was saved before the preemption


def test_blocks_a_load_left_unfilled_are_saved_again_once_recomputed() -> None:
    """vLLM recomputes from the first failed block (the worker stored none of that step's
    chunks): the request's chunks from that block's chunk on are saved as they complete
    again, and a later reload (preemption) asks only for the chunks before it."""
    scheduler, _ = make_scheduler(FakeTier(held=2))
    req = request(1000)
    ext, _ = scheduler.get_num_new_matched_tokens(req, 0)
    ids = list(range(10, 18))
    scheduler.update_state_after_alloc(req, blocks(ids), ext)
    first = scheduler.build_connector_meta(step([(req, ids, 512, 488)]))
    assert [s.block_ids for s in first.saves] == [(14, 15)]  # chunk 2

    scheduler.blocks_failed({13, 99})  # chunk 1's second block; 99 is no request's
    recomputed = scheduler.build_connector_meta(cached_step({"r": (256, 744)}))

    assert recomputed.loads == []
    assert [s.block_ids for s in recomputed.saves] == [(12, 13), (14, 15)]  # chunks 1 and 2
    ext_again, _ = scheduler.get_num_new_matched_tokens(req, 0)  # preempted, rescheduled
    assert ext_again == 256


@pytest.mark.parametrize("steps_ahead", [0, 1])
def test_every_save_the_worker_dropped_after_a_failed_load_is_planned_again(
    steps_ahead: int,
) -> None:
    """The worker drops every save of the failed step (and, under asynchronous
    scheduling, of the step planned before vLLM saw it), those of requests whose blocks
    did not fail included: each is planned again in the next step."""
    scheduler, _ = make_scheduler(FakeTier(held=0), steps_ahead=steps_ahead)
    failing, other = request(1000, "failing"), request(1000, "other")
    for req in (failing, other):
        scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(failing, blocks(list(range(8))), 0)
    scheduler.update_state_after_alloc(other, blocks(list(range(8, 16))), 0)
    failed_step = scheduler.build_connector_meta(
        step([(failing, list(range(8)), 0, 512), (other, list(range(8, 16)), 0, 512)])
    )
    assert len(failed_step.saves) == 4  # chunks 0 and 1 of each
    if steps_ahead:  # planned before vLLM saw the failed step's output
        ahead = scheduler.build_connector_meta(cached_step({"other": (512, 256)}))
        assert [s.block_ids for s in ahead.saves] == [(12, 13)]  # other's chunk 2

    scheduler.blocks_failed({1})  # the failing request's chunk 0
    computed = 512 + 256 * steps_ahead  # the other request's tokens so far: no new chunk
    again = scheduler.build_connector_meta(
        cached_step({"failing": (0, 512), "other": (computed, 8)})
    )

    assert [s.block_ids for s in again.saves] == [(0, 1), (2, 3), (8, 9), (10, 11)] + (
        [(12, 13)] if steps_ahead else []
    )


def test_failed_blocks_of_no_request_replan_only_the_dropped_saves() -> None:
    scheduler, _ = make_scheduler(FakeTier(held=1))
    req = request(1000)
    ext, _ = scheduler.get_num_new_matched_tokens(req, 0)
    ids = list(range(8))
    scheduler.update_state_after_alloc(req, blocks(ids), ext)
    first = scheduler.build_connector_meta(step([(req, ids, 256, 744)]))
    assert [s.block_ids for s in first.saves] == [(2, 3), (4, 5)]
    scheduler.blocks_failed(set())
    scheduler.blocks_failed({50, 51})  # the worker dropped this step's saves all the same
    again = scheduler.build_connector_meta(cached_step({"r": (1000, 1)}))
    assert [s.block_ids for s in again.saves] == [(2, 3), (4, 5)]
    assert scheduler.get_num_new_matched_tokens(req, 0)[0] == 256  # the hit stands


def test_a_request_that_shared_a_failed_block_and_is_not_recomputed_saves_nothing_from_it() -> None:
    """Asynchronous scheduling: D hit A's blocks in vLLM's prefix cache in the step planned
    before vLLM saw that A's load of them failed. vLLM recomputes A from the failed block
    but keeps what D computed on it: D's chunks from that block's chunk on are never
    saved; A's are, once vLLM is seen recomputing them."""
    scheduler, _ = make_scheduler(FakeTier(held=0), steps_ahead=1)
    a, d = request(1000, "a"), request(1000, "d")
    for req in (a, d):
        scheduler.get_num_new_matched_tokens(req, 0)
    a_ids, d_ids = list(range(8)), [0, 1, 2, 3, 40, 41, 42, 43]  # D shares chunks 0 and 1
    scheduler.update_state_after_alloc(a, blocks(a_ids), 0)
    scheduler.build_connector_meta(step([(a, a_ids, 0, 1000)]))  # the failed step
    scheduler.update_state_after_alloc(d, blocks(d_ids), 0)
    scheduler.build_connector_meta(step([(d, d_ids, 512, 488)]))  # planned before vLLM saw it

    scheduler.blocks_failed({2})  # A's chunk 1
    after = scheduler.build_connector_meta(cached_step({"a": (256, 744), "d": (1000, 1)}))
    later = scheduler.build_connector_meta(cached_step({"a": (1000, 1), "d": (1001, 1)}))

    assert [s.block_ids for s in after.saves] == [(0, 1), (2, 3), (4, 5), (0, 1)]  # D: chunk 0
    assert later.saves == []


def test_an_engine_whose_one_group_frees_blocks_replans_nothing() -> None:
    """A sliding window's old block ids may be freed and reused since the step planned
    them: nothing is saved from them again (the worker's drop stands)."""
    spec = KeySpec(model_id="m", block_size=BLOCK, chunk_size=CHUNK)
    group = KVGroup(BLOCK, SLIDING_WINDOW, 256, specs=(spec,))
    cfg = ConnectorConfig.from_extra_config({"target": "h:1", "chunk_size": CHUNK})
    breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown_s)
    scheduler = KvtierScheduler(
        cfg, [spec], FakeTier(), breaker=breaker, recorder=Recorder(), groups=[group]
    )
    req = request(1000)
    scheduler.get_num_new_matched_tokens(req, 0)
    ids = list(range(10, 18))  # 0 is vLLM's null block
    scheduler.update_state_after_alloc(req, blocks(ids), 0)
    first = scheduler.build_connector_meta(step([(req, ids, 0, 1000)]))
    assert first.saves

    scheduler.blocks_failed({10})
    again = scheduler.build_connector_meta(cached_step({"r": (0, 1000)}))

    assert again.saves == []


def test_finished_request_is_forgotten() -> None:
    tier = FakeTier(held=1)
    scheduler, _ = make_scheduler(tier)
    req = request(1000)
    scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.request_finished(req)
    scheduler.get_num_new_matched_tokens(req, 0)
    assert len(tier.lookups) == 2


class SlowTier:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.stored: list[bytes] = []

    def put(self, items: Iterable[tuple[bytes, Any]], *, timeout_s: float | None = None) -> int:
        self.release.wait(10)
        keys = [k for k, _ in items]
        self.stored += keys
        return len(keys)

    def delete(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        return 0


def test_sender_drops_instead_of_blocking_when_queue_is_full() -> None:
    tier, recorder = SlowTier(), Recorder()
    sender = SaveSender(
        tier, capacity=2, batch=1, timeout_s=1, breaker=CircuitBreaker(3, 1), recorder=recorder
    )
    try:
        offered = [sender.offer(bytes([i]), [b"x"], 1) for i in range(6)]
        assert offered.count(False) >= 3  # one in flight, two queued, the rest dropped
        assert recorder.total("saves_dropped", "queue_full") == offered.count(False)
        tier.release.set()
        assert sender.flush(5)
        assert len(tier.stored) == offered.count(True)
        assert recorder.total("saved_chunks") == offered.count(True)
    finally:
        tier.release.set()
        sender.close()


@pytest.mark.parametrize("role", ["kv_both"])
def test_metadata_is_picklable(role: str) -> None:
    import pickle

    scheduler, _ = make_scheduler(FakeTier(held=1))
    req = request(1000)
    ext, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, blocks(list(range(8))), ext)
    meta = scheduler.build_connector_meta(step([(req, list(range(8)), 256, 744)]))
    again = pickle.loads(pickle.dumps(meta))
    assert isinstance(again, StepPlan) and again == meta


# -- the fixed salt, bad multimodal data, tensor-parallel keys --------------------


def make_specs_scheduler(
    tier: FakeTier, specs: list[KeySpec], **config: Any
) -> tuple[KvtierScheduler, Recorder]:
    cfg = ConnectorConfig.from_extra_config({"target": "h:1", "chunk_size": CHUNK, **config})
    recorder = Recorder()
    breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown_s)
    return KvtierScheduler(cfg, specs, tier, breaker=breaker, recorder=recorder), recorder


def test_engine_salt_changes_keys_even_when_request_salts_are_ignored() -> None:
    from dataclasses import replace

    spec = KeySpec(model_id="m", block_size=BLOCK, chunk_size=CHUNK)
    found = []
    for salt in ("", "ns-a", "ns-b"):
        tier = FakeTier()
        scheduler, _ = make_specs_scheduler(tier, [replace(spec, salt=salt)], salt_policy="none")
        scheduler.get_num_new_matched_tokens(request(600, salt="ignored"), 0)
        found.append(tier.lookups[0])
    assert len({key for keys in found for key in keys}) == 3 * len(found[0])


def test_engine_salt_alone_does_not_satisfy_the_required_policy() -> None:
    tier = FakeTier(held=3)
    spec = KeySpec(model_id="m", block_size=BLOCK, chunk_size=CHUNK, salt="ns")
    scheduler, recorder = make_specs_scheduler(tier, [spec], salt_policy="required", salt="ns")
    assert scheduler.get_num_new_matched_tokens(request(1000), 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(request(1000), 0) == (0, False)
    assert tier.lookups == []
    assert recorder.total("requests_skipped", "no_salt") == 1  # judged once per request


def mm_feature(identifier: Any, offset: Any, length: Any) -> Any:
    return SimpleNamespace(
        identifier=identifier,
        mm_hash=identifier,
        mm_position=SimpleNamespace(offset=offset, length=length),
    )


@pytest.mark.parametrize(
    "features",
    [
        [mm_feature("img", -5, 64)],
        [mm_feature("img", 300, 0)],
        [mm_feature(None, 300, 64)],
        [mm_feature("img", "300", 64)],
        [mm_feature("a", 300, 64), mm_feature("b", 320, 64)],  # overlapping
    ],
    ids=["negative-offset", "empty-span", "no-identifier", "offset-not-int", "overlap"],
)
def test_bad_multimodal_data_is_no_hit_for_that_request_only(features: list[Any]) -> None:
    tier = FakeTier(held=3)
    scheduler, recorder = make_scheduler(tier)
    bad = request(1000, "bad", mm=features)

    assert scheduler.get_num_new_matched_tokens(bad, 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(bad, 0) == (0, False)  # rescheduled
    assert scheduler.get_num_new_matched_tokens(request(1000, "good"), 0) == (768, False)

    assert recorder.total("requests_skipped", "bad_input") == 1
    assert len(tier.lookups) == 1  # only the good request asked the tier
    plan = scheduler.build_connector_meta(step([(bad, list(range(8)), 0, 1000)]))
    assert plan.loads == [] and plan.saves == []  # and the bad one is never saved


def test_token_ids_out_of_range_are_no_hit_not_a_crash() -> None:
    tier = FakeTier(held=3)
    scheduler, recorder = make_scheduler(tier)
    req = request(1000)
    req.prompt_token_ids[5] = -1
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    assert recorder.total("requests_skipped", "bad_input") == 1


def test_each_tensor_parallel_rank_gets_its_own_keys() -> None:
    from kvtier.connector.chunks.keys import chunk_keys

    specs = [
        KeySpec(model_id="m", block_size=BLOCK, chunk_size=CHUNK, tp_rank=r, tp_world_size=2)
        for r in range(2)
    ]
    tier = FakeTier(held=1)
    scheduler, _ = make_specs_scheduler(tier, specs)
    req = request(1000, mm=[mm_feature("img", 300, 64)])
    ext, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, blocks(list(range(8))), ext)
    plan = scheduler.build_connector_meta(step([(req, list(range(8)), 256, 744)]))

    from kvtier.connector.chunks.keys import MMItem

    items = [MMItem("img", 300, 64)]
    expected = [chunk_keys(req.prompt_token_ids, items, spec) for spec in specs]
    assert plan.loads[0].chunks[0].keys == (expected[0][0], expected[1][0])
    assert [s.keys for s in plan.saves] == [(expected[0][c], expected[1][c]) for c in (1, 2)]
    assert tier.lookups == [expected[0]]  # one Lookup, with rank 0's keys
