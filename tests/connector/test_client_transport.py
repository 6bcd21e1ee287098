"""How TierClient picks its transport: once per connection, again after a failure
(``kvtier.connector.client.transport``), against real ``kvtier server`` processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.connector.client import TierClient
from kvtier.connector.errors import TierUnavailable
from kvtier.testing.redisprocs import free_port
from kvtier.testing.tierproc import TierProcess

REQUESTS = "kvtier_server_requests_total"


@pytest.fixture
def data_tier(tmp_path: Path) -> Iterator[TierProcess]:
    tier = TierProcess.start(tmp_path / "tier", "--data-port", str(free_port()))
    yield tier
    tier.stop()


@pytest.fixture
def grpc_tier(tmp_path: Path) -> Iterator[TierProcess]:
    tier = TierProcess.start(tmp_path / "tier", data_port=False)
    yield tier
    tier.stop()


def stats_calls(tier: TierProcess) -> float:
    return tier.metric(REQUESTS, op="Stats", code="OK")


def every_call(client: TierClient) -> None:
    client.put([(b"k", b"v")])
    assert client.lookup([b"k"]) == 1
    assert [bytes(v) for v in client.get([b"k"]) if v is not None] == [b"v"]
    assert client.delete([b"k"]) == 1


def test_the_transport_is_picked_once_per_connection_with_one_stats_call(
    data_tier: TierProcess,
) -> None:
    with TierClient(data_tier.target) as client:
        assert client.transport == ""
        for _ in range(3):
            every_call(client)
        assert client.transport == "data"
    assert stats_calls(data_tier) == 1
    assert data_tier.metric(REQUESTS, op="DataPut", code="OK") == 3
    assert data_tier.metric(REQUESTS, op="Put", code="OK") == 0


def test_callers_that_start_together_share_one_pick(data_tier: TierProcess) -> None:
    with TierClient(data_tier.target) as client:
        errors: list[BaseException] = []

        def call() -> None:
            try:
                client.get([b"absent"])
            except BaseException as exc:  # handed to the test thread
                errors.append(exc)

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
    assert stats_calls(data_tier) == 1


def test_a_grpc_client_never_asks_the_tier_for_its_transports(data_tier: TierProcess) -> None:
    with TierClient(data_tier.target, data_path="grpc") as client:
        every_call(client)
        assert client.transport == "grpc"
    assert stats_calls(data_tier) == 0
    assert data_tier.metric(REQUESTS, op="Put", code="OK") == 1


def test_a_tier_without_a_data_port_is_not_asked_again_on_every_call(
    grpc_tier: TierProcess,
) -> None:
    with TierClient(grpc_tier.target) as client:
        for _ in range(3):
            every_call(client)
        assert client.transport == "grpc"
    assert stats_calls(grpc_tier) == 1


def test_a_failed_call_makes_the_next_call_pick_again(data_tier: TierProcess) -> None:
    with TierClient(data_tier.target) as client:
        client.put([(b"k", b"v")])
        data_tier.freeze()
        try:
            with pytest.raises(TierUnavailable, match="DEADLINE_EXCEEDED"):
                client.get([b"k"], timeout_s=0.5)
            assert client.transport == ""  # the failed transport was dropped
        finally:
            data_tier.thaw()

        assert [bytes(v) for v in client.get([b"k"]) if v is not None] == [b"v"]
        assert client.transport == "data"
    assert stats_calls(data_tier) == 2


def test_a_frozen_tier_costs_one_deadline_for_the_pick_and_the_call_together(
    data_tier: TierProcess,
) -> None:
    """The pick's Stats and the call share the call's deadline (not one each)."""
    with TierClient(data_tier.target) as client:
        data_tier.freeze()
        try:
            started = time.monotonic()
            with pytest.raises(TierUnavailable):
                client.get([b"k"], timeout_s=2.0)
            elapsed = time.monotonic() - started
        finally:
            data_tier.thaw()
    assert elapsed < 3.5  # two deadlines would be 4 s
