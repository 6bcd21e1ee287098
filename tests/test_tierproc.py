"""The test harness's tier processes (kvtier.testing.tierproc): ports that never collide."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import kvtier.testing.tierproc as tierproc
from kvtier.connector.client import TierClient
from kvtier.proto import datawire as dw
from kvtier.proto.datawire import Op, Status
from kvtier.testing.redisprocs import free_ports
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.waits import wait_for


def hello(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(dw.request(Op.HELLO, 0, 0))
        head = b""
        while len(head) < dw.REPLY.size:
            head += sock.recv(dw.REPLY.size - len(head))
        return int(dw.REPLY.unpack(head)[3])


def test_a_tiers_grpc_metrics_and_data_ports_differ_and_each_serves_its_protocol(tmp_path: Path) -> None:
    tier = TierProcess.start(tmp_path / "tier", data_port=True)
    try:
        assert len({tier.port, tier.metrics_port, tier.data_port}) == 3
        with TierClient(tier.target, data_path="data") as c:
            assert c.stats().data_port == tier.data_port
        assert hello(tier.data_port) == Status.OK
        assert "kvtier_server_serving 1.0" in tier.metrics()
    finally:
        tier.stop()


def test_ports_picked_together_are_all_different() -> None:
    for _ in range(200):
        ports = free_ports(3)
        assert len(set(ports)) == 3


def test_a_port_another_process_took_first_costs_a_retry_on_new_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = socket.create_server(("127.0.0.1", 0))  # another process's listener
    picks = iter([[taken.getsockname()[1], *free_ports(2)]])
    monkeypatch.setattr(tierproc, "free_ports", lambda n: next(picks, None) or free_ports(n))
    try:
        tier = TierProcess.start(tmp_path / "tier", data_port=True)
        try:
            assert tier.port != taken.getsockname()[1]
            with TierClient(tier.target) as c:
                assert c.lookup([b"k"]) == 0
        finally:
            tier.stop()
    finally:
        taken.close()


def test_the_harness_turns_on_what_the_operator_renders_for_a_default_tier(tmp_path: Path) -> None:
    from kvtier.operator.children import tier_settings
    from kvtier.operator.spec import parse_cache_tier

    body = {"kind": "CacheTier", "metadata": {"name": "t", "namespace": "ns", "uid": "u"}, "spec": {}}
    rendered = tier_settings(parse_cache_tier(body))
    tier = TierProcess.start(tmp_path / "tier")
    try:
        for env, port in (("KVTIER_DATA_PORT", tier.data_port), ("KVTIER_METRICS_PORT", tier.metrics_port)):
            assert (rendered[env] != "0") == (port != 0), f"{env}: the operator renders {rendered[env]}"
        with TierClient(tier.target) as auto:  # the connector's default path
            auto.put([(b"k", b"v")])
            assert auto.transport == "data"
        # The tier counts a request once its reply is sent: the count may trail the reply.
        assert wait_for(lambda: tier.metric("kvtier_server_requests_total", op="DataPut", code="OK") == 1)
    finally:
        tier.stop()
