"""How TierClient picks the same-node transport (``local_socket``) and falls back from it:
the data port, then gRPC, and the socket again once it answers; on real tier processes."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.connector.client import TierClient, tierclient
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.errors import ConfigError, TierUnavailable
from kvtier.connector.factory import connect
from kvtier.connector.metrics import KV
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.waits import wait_for

REQUESTS = "kvtier_server_requests_total"


def every_call(client: TierClient) -> None:
    client.put([(b"k", b"v" * 100_000)])
    assert client.lookup([b"k"]) == 1
    assert [bytes(v) for v in client.get([b"k"]) if v is not None] == [b"v" * 100_000]
    assert client.delete([b"k"]) == 1


def test_auto_moves_every_call_over_the_socket_when_it_answers(start_tier: Callable[..., TierProcess]) -> None:
    tier = start_tier(local_socket=True, data_port=True)
    with TierClient(tier.target, local_socket=tier.local_socket) as client:
        every_call(client)
        assert client.transport == "local"
    for op in ("LocalPut", "LocalLookup", "LocalGet", "LocalDelete"):  # (counted once the reply is sent)
        assert wait_for(lambda op=op: tier.metric(REQUESTS, op=op, code="OK") >= 1)
    for op in ("Stats", "Lookup", "DataPut", "Put"):  # no gRPC call, not even the pick's Stats
        assert tier.metric(REQUESTS, op=op, code="OK") == 0


@pytest.mark.parametrize("data_port", [True, False], ids=["data port", "gRPC only"])
def test_auto_falls_back_to_the_data_port_then_grpc_when_the_socket_is_missing(
    start_tier: Callable[..., TierProcess], tmp_path: Path, data_port: bool, caplog: pytest.LogCaptureFixture
) -> None:
    tier = start_tier(data_port=data_port)
    missing = str(tmp_path / "no-tier-here.sock")
    with caplog.at_level(logging.WARNING, "kvtier"), TierClient(tier.target, local_socket=missing) as client:
        every_call(client)
        every_call(client)
        assert client.transport == ("data" if data_port else "grpc")
    warnings = [r.getMessage() for r in caplog.records if "no-tier-here.sock" in r.getMessage()]
    assert len(warnings) == 1 and "trying the socket again in 60s" in warnings[0]


def test_a_socket_that_answers_later_is_used_once_the_retry_wait_is_over(
    start_tier: Callable[..., TierProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tierclient, "DATA_RETRY_S", 0.5)
    tier = start_tier(local_socket=True, data_port=True)
    hidden = tier.local_socket + ".hidden"
    os.rename(tier.local_socket, hidden)  # the tier's pod is not up on this node yet
    with TierClient(tier.target, local_socket=tier.local_socket) as client:
        every_call(client)
        assert client.transport == "data"
        os.rename(hidden, tier.local_socket)  # now it is
        time.sleep(0.6)
        every_call(client)
        assert client.transport == "local"


def test_a_tier_whose_socket_goes_away_is_reached_over_tcp_meanwhile(
    start_tier: Callable[..., TierProcess],
) -> None:
    tier = start_tier("--data-timeout", "1s", local_socket=True, data_port=True)
    with TierClient(tier.target, local_socket=tier.local_socket, timeout_s=10) as client:
        every_call(client)
        assert client.transport == "local"
        os.rename(tier.local_socket, tier.local_socket + ".gone")
        time.sleep(1.5)  # the tier closes the idle connection: the next call must connect again
        every_call(client)
        assert client.transport == "data"


def test_data_path_local_requires_the_socket(start_tier: Callable[..., TierProcess], tmp_path: Path) -> None:
    tier = start_tier(data_port=True)
    with pytest.raises(ConfigError, match="data_path='local' needs local_socket"):
        TierClient(tier.target, data_path="local")
    with (
        TierClient(tier.target, local_socket=str(tmp_path / "none.sock"), data_path="local") as client,
        pytest.raises(TierUnavailable, match=r"none\.sock"),
    ):
        client.lookup([b"k"])


def test_data_path_data_never_uses_the_socket(start_tier: Callable[..., TierProcess]) -> None:
    tier = start_tier(local_socket=True, data_port=True)
    with TierClient(tier.target, local_socket=tier.local_socket, data_path="data") as client:
        every_call(client)
        assert client.transport == "data"


def test_the_connector_config_takes_local_socket_and_hands_it_to_the_client(
    start_tier: Callable[..., TierProcess],
) -> None:
    tier = start_tier(local_socket=True)
    config = ConnectorConfig.from_extra_config({"target": tier.target, "local_socket": tier.local_socket})
    link = connect(config, KV)
    try:
        link.warm_up(config, "requests recompute")
        assert link.client.transport == "local"
    finally:
        link.close()
    with pytest.raises(ConfigError, match="local_socket must be a non-empty string"):
        ConnectorConfig.from_extra_config({"target": tier.target, "local_socket": ""})
