"""The encoder cache's scheduler and worker halves against a real tier (gRPC on loopback).

Requests and their multimodal features are plain namespaces with the attributes
vLLM 0.32 gives them (``MultiModalFeatureSpec``, ``PlaceholderRange``); the real
engine runs in test_ec_vllm.py. The rule under test: ``has_cache_item`` says yes only for an entry
in hand that decoded and fits the item, so the worker can always deliver it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.connector import metrics
from kvtier.connector.chunks.codec import encode_chunk_bytes
from kvtier.connector.chunks.encoder_keys import EncoderKeySpec
from kvtier.connector.client import TierClient
from kvtier.connector.client.breaker import CircuitBreaker
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.encoder.scheduler import KvtierECScheduler
from kvtier.connector.encoder.worker import KvtierECWorker
from kvtier.connector.errors import ConfigError
from kvtier.connector.metrics import Recorder
from kvtier.testing.redisprocs import free_port
from kvtier.testing.tierproc import TierProcess


def parse_config(extra: dict[str, Any]) -> ConnectorConfig:
    """As the encoder-cache connector reads its ``ec_connector_extra_config``."""
    return ConnectorConfig.from_extra_config(extra, name="ec_connector_extra_config")


SPEC = EncoderKeySpec(model_id="tiny-vl")
EMBEDS, WIDTH = 4, 8


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TierProcess]:
    tier = TierProcess.start(tmp_path_factory.mktemp("tier"))
    yield tier
    tier.stop()


@pytest.fixture
def client(tier: TierProcess) -> Iterator[TierClient]:
    with TierClient(tier.target, timeout_s=5.0) as client:
        yield client


def feature(identifier: str, offset: int = 10, modality: str = "image") -> Any:
    position = SimpleNamespace(offset=offset, length=EMBEDS, get_num_embeds=lambda: EMBEDS)
    return SimpleNamespace(identifier=identifier, modality=modality, mm_position=position)


def request(*features: Any, req_id: str = "r", salt: str | None = None) -> Any:
    return SimpleNamespace(
        request_id=req_id, mm_features=list(features), cache_salt=salt, lora_request=None
    )


def scheduler(
    client: TierClient, *, held_bytes: int = 1 << 20, **config: Any
) -> tuple[KvtierECScheduler, Recorder]:
    cfg = parse_config({"target": client.target, "chunk_size": 256, **config})
    recorder = Recorder(metrics.EC)
    breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown_s)
    sched = KvtierECScheduler(
        cfg, SPEC, client, breaker=breaker, recorder=recorder, load=True, save=True,
        held_bytes=held_bytes,
    )  # fmt: skip
    return sched, recorder


def output(seed: int, embeds: int = EMBEDS) -> torch.Tensor:
    return torch.randn(embeds, WIDTH, generator=torch.Generator().manual_seed(seed)).to(
        torch.bfloat16
    )


def store(
    client: TierClient, sched: KvtierECScheduler, req: Any, index: int, tensor: torch.Tensor
) -> bytes:
    """Save ``tensor`` as the item's encoder output the way the worker does."""
    key = sched.key(req, req.mm_features[index])
    assert key is not None
    worker = KvtierECWorker(
        parse_config({"target": client.target}), client, device="cpu",
        breaker=CircuitBreaker(3, 1.0), recorder=Recorder(metrics.EC),
    )  # fmt: skip
    identifier = req.mm_features[index].identifier
    plan = SimpleNamespace(saves={identifier: key}, loads=[])
    worker.save(plan, {identifier: tensor}, identifier)  # type: ignore[arg-type]
    assert worker.sender.flush(10.0)
    worker.shutdown()
    return key


def test_a_stored_output_is_promised_planned_and_placed_bit_for_bit(client: TierClient) -> None:
    sched, recorder = scheduler(client)
    req = request(feature("img-1"))
    tensor = output(1)
    store(client, sched, req, 0, tensor)

    assert sched.ensure_cache_available(req, 0)
    assert sched.has_cache_item("img-1")
    sched.update_state_after_alloc(req, 0)
    plan = sched.build_connector_meta()

    cache: dict[str, torch.Tensor] = {}
    worker = KvtierECWorker(
        parse_config({"target": client.target}), client, device="cpu",
        breaker=CircuitBreaker(3, 1.0), recorder=Recorder(metrics.EC),
    )  # fmt: skip
    worker.load(plan, cache)
    worker.shutdown()
    assert torch.equal(cache["img-1"], tensor) and cache["img-1"].dtype == torch.bfloat16
    assert (recorder.total("lookups"), recorder.total("hits")) == (1, 1)
    assert recorder.total("loaded_bytes") == tensor.numel() * 2
    assert plan.saves == {}


def test_a_missing_output_is_not_promised_and_its_key_goes_to_the_save_plan(
    client: TierClient,
) -> None:
    sched, recorder = scheduler(client)
    req = request(feature("never-stored"))

    sched.ensure_cache_available(req, 0)
    assert not sched.has_cache_item("never-stored")
    sched.update_state_after_alloc(req, 0)
    plan = sched.build_connector_meta()

    assert plan.loads == [] and plan.saves == {"never-stored": sched.key(req, req.mm_features[0])}
    assert (recorder.total("lookups"), recorder.total("hits")) == (1, 0)


def test_a_corrupt_entry_is_a_miss_counted_and_deleted(client: TierClient) -> None:
    sched, recorder = scheduler(client)
    req = request(feature("img-corrupt"))
    key = store(client, sched, req, 0, output(2))
    (blob,) = client.get([key])
    assert blob is not None
    damaged = bytearray(blob)
    damaged[-1] ^= 0xFF
    client.put([(key, bytes(damaged))])

    sched.ensure_cache_available(req, 0)

    assert not sched.has_cache_item("img-corrupt")
    assert recorder.total("corrupt_chunks") == 1
    sched.shutdown()  # flushes the delete
    assert client.get([key]) == [None]


def test_an_entry_of_another_length_than_the_placeholder_is_a_miss(client: TierClient) -> None:
    """A user-supplied uuid reused for other content: the stored output does not fit."""
    sched, recorder = scheduler(client)
    req = request(feature("uuid-reused"))
    key = sched.key(req, req.mm_features[0])
    assert key is not None
    wrong = output(3, embeds=EMBEDS + 1)
    client.put(
        [
            (
                key,
                encode_chunk_bytes(
                    key, wrong.view(torch.uint8).numpy(), dtype="bfloat16", shape=tuple(wrong.shape)
                ),
            )
        ]
    )

    sched.ensure_cache_available(req, 0)

    assert not sched.has_cache_item("uuid-reused")
    assert recorder.total("corrupt_chunks") == 1


def test_items_already_computed_are_not_asked_for(client: TierClient) -> None:
    sched, recorder = scheduler(client)
    req = request(feature("early", offset=0), feature("late", offset=100))

    sched.ensure_cache_available(req, 50)
    sched.has_cache_item("early")
    sched.has_cache_item("late")

    assert recorder.total("lookups") == 1  # only "late"


def test_one_request_asks_the_tier_once_per_item(client: TierClient) -> None:
    sched, recorder = scheduler(client)
    req = request(feature("x"), feature("y", offset=20))

    for _ in range(3):
        sched.ensure_cache_available(req, 0)
        sched.has_cache_item("x")
        sched.has_cache_item("y")

    assert recorder.total("lookups") == 2
    sched.request_finished(req)
    sched.ensure_cache_available(req, 0)
    sched.has_cache_item("x")
    assert recorder.total("lookups") == 3


def test_an_item_whose_kv_load_failed_is_fetched_when_vllm_recomputes_it(
    client: TierClient,
) -> None:
    # The KV connector's hit covers the item (computed tokens 512), so it is not noted;
    # the load then fails and vLLM recomputes from token 256, item included. vLLM 0.32
    # dropped the item's data when the hit covered it, so its encoder output must come
    # from the tier (before, the item was noted once per request: "Encoder cache miss").
    sched, recorder = scheduler(client)
    req = request(feature("img-kv", offset=300))
    tensor = output(7)
    store(client, sched, req, 0, tensor)

    sched.ensure_cache_available(req, 512)
    assert recorder.total("lookups") == 0
    sched.ensure_cache_available(req, 256)  # the next step, after the failed load

    assert sched.has_cache_item("img-kv")  # fetched and verified: promised to vLLM
    assert recorder.total("lookups") == 1
    sched.ensure_cache_available(req, 256)  # noted once: asked once
    sched.has_cache_item("img-kv")
    assert recorder.total("lookups") == 1


def test_items_vllm_holds_itself_are_never_fetched(client: TierClient, tier: TierProcess) -> None:
    """vLLM asks has_cache_item only about items its own encoder cache lacks: an image
    the engine still holds (a repeat, or another running request's) costs no Get."""
    sched, recorder = scheduler(client)
    first, repeat = request(feature("seen"), req_id="1"), request(feature("seen"), req_id="2")
    store(client, sched, first, 0, output(7))
    gets = tier.metric("kvtier_server_get_keys_total", result="hit")

    sched.ensure_cache_available(first, 0)
    assert sched.has_cache_item("seen")
    sched.update_state_after_alloc(first, 0)
    sched.build_connector_meta()
    sched.ensure_cache_available(repeat, 0)  # vLLM found it in its encoder cache: no question
    sched.request_finished(first)
    sched.request_finished(repeat)

    assert recorder.total("lookups") == 1
    assert tier.metric("kvtier_server_get_keys_total", result="hit") == gets + 1
    assert not sched.has_cache_item("seen")  # no live request noted it: nothing to fetch
    assert recorder.total("lookups") == 1


def test_a_failed_fetch_costs_one_deadline_for_every_noted_item() -> None:
    with TierClient(f"127.0.0.1:{free_port()}", timeout_s=1.0) as dead:
        sched, recorder = scheduler(dead, breaker_failures=5, lookup_timeout_s=0.5)
        req = request(feature("a"), feature("b", offset=20), feature("c", offset=30))
        sched.ensure_cache_available(req, 0)
        assert [sched.has_cache_item(i) for i in "abc"] == [False, False, False]
    assert recorder.total("errors", label="load") == 1
    assert recorder.total("lookups") == 1


def test_the_cache_salt_separates_tenants(client: TierClient) -> None:
    sched, _ = scheduler(client)
    store(client, sched, request(feature("shared"), salt="tenant-a"), 0, output(4))

    sched.ensure_cache_available(request(feature("shared"), req_id="b", salt="tenant-b"), 0)

    assert not sched.has_cache_item("shared")
    sched.ensure_cache_available(request(feature("shared"), req_id="a", salt="tenant-a"), 0)
    assert sched.has_cache_item("shared")


def test_salt_policy_required_neither_looks_up_nor_saves_unsalted_requests(
    client: TierClient,
) -> None:
    sched, recorder = scheduler(client, salt_policy="required")
    req = request(feature("unsalted"))

    sched.ensure_cache_available(req, 0)
    assert not sched.has_cache_item("unsalted")
    sched.update_state_after_alloc(req, 0)

    assert recorder.total("lookups") == 0
    assert sched.build_connector_meta().saves == {}


def test_a_promised_entry_survives_the_byte_bound_until_it_is_planned(client: TierClient) -> None:
    sched, _ = scheduler(client, held_bytes=EMBEDS * WIDTH * 2)  # room for one entry
    first, second = request(feature("p1"), req_id="1"), request(feature("p2"), req_id="2")
    store(client, sched, first, 0, output(5))
    store(client, sched, second, 0, output(6))

    sched.ensure_cache_available(first, 0)
    assert sched.has_cache_item("p1")
    sched.ensure_cache_available(second, 0)
    assert sched.has_cache_item("p2")  # its fetch would evict p1 if p1 were not promised
    sched.update_state_after_alloc(first, 0)

    assert [load.identifier for load in sched.build_connector_meta().loads] == ["p1"]


def test_a_dead_tier_is_a_miss_and_opens_the_breaker() -> None:
    with TierClient(f"127.0.0.1:{free_port()}", timeout_s=1.0) as dead:
        sched, recorder = scheduler(dead, breaker_failures=2, lookup_timeout_s=0.5)
        for i in range(4):
            req = request(feature(f"d{i}"), req_id=str(i))
            assert sched.ensure_cache_available(req, 0)
            assert not sched.has_cache_item(f"d{i}")
    assert recorder.total("errors", label="load") == 2
    assert recorder.total("calls_skipped", label="load") == 2


def test_the_ec_config_accepts_the_kv_connectors_keys_and_names_its_own_field() -> None:
    config = parse_config({"target": "h:1", "chunk_size": 512, "salt_policy": "none"})
    assert config.salt_policy == "none"
    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.salt_policy"):
        parse_config({"target": "h:1", "salt_policy": "sometimes"})


def test_an_unsupported_output_dtype_is_dropped_and_counted(
    client: TierClient, tmp_path: Path
) -> None:
    recorder = Recorder(metrics.EC)
    worker = KvtierECWorker(
        parse_config({"target": client.target}), client, device="cpu",
        breaker=CircuitBreaker(3, 1.0), recorder=recorder,
    )  # fmt: skip
    plan = SimpleNamespace(saves={"i": b"k" * 32}, loads=[])
    worker.save(plan, {"i": torch.zeros(2, 2, dtype=torch.float64)}, "i")  # type: ignore[arg-type]
    worker.shutdown()
    assert recorder.total("saves_dropped", label="unsupported") == 1


def test_an_output_holding_a_nan_is_neither_stored_nor_loaded(client: TierClient) -> None:
    """An encoder output with a NaN or an infinity would put it into every engine that
    loads the item: its save is dropped (``nonfinite``), and one stored by a writer that
    does not check is a miss, counted and deleted."""
    sched, recorder = scheduler(client)
    req = request(feature("img-nan"))
    key = sched.key(req, req.mm_features[0])
    assert key is not None
    bad = output(3)
    bad[1, 2] = float("inf")
    saver = Recorder(metrics.EC)
    worker = KvtierECWorker(
        parse_config({"target": client.target}), client, device="cpu",
        breaker=CircuitBreaker(3, 1.0), recorder=saver,
    )  # fmt: skip
    worker.save(SimpleNamespace(saves={"img-nan": key}, loads=[]), {"img-nan": bad}, "img-nan")  # type: ignore[arg-type]
    assert worker.sender.flush(10.0)
    worker.shutdown()
    assert saver.total("saves_dropped", label="nonfinite") == 1
    assert client.get([key]) == [None]

    payload = bad.reshape(-1).view(torch.uint8).numpy()
    client.put([(key, encode_chunk_bytes(key, payload, dtype="bfloat16", shape=tuple(bad.shape)))])
    sched.ensure_cache_available(req, 0)

    assert not sched.has_cache_item("img-nan")
    assert recorder.total("corrupt_chunks") == 1
    sched.shutdown()  # flushes the delete
    assert client.get([key]) == [None]
