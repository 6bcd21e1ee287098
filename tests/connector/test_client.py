"""TierClient against a real ``kvtier server`` process over loopback gRPC: reconnecting to a
restarted tier, and taking a rotated token from ``token_file``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.connector.client import TierClient
from kvtier.connector.errors import ConfigError, TierRejected, TierUnavailable
from kvtier.testing.tierproc import TierProcess

TOKEN = "t" * 24 + "-tenant-a-token"
DOWN_S = 6.0  # long enough for gRPC's default backoff to grow past 4 s (1, 1.6, 2.6 s...)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[TierProcess]:
    tier = TierProcess.start(tmp_path / "tier")
    yield tier
    tier.stop()


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[TierProcess]:
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "team-a").write_text(TOKEN)
    tier = TierProcess.start(tmp_path / "tier", "--auth-tokens", str(tokens))
    yield tier
    tier.stop()


def call_while_down(clients: list[TierClient], seconds: float) -> None:
    """Keep calling a dead tier, as an engine does, so every channel backs off."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for client in clients:
            with pytest.raises(TierUnavailable):
                client.lookup([b"k"], timeout_s=0.3)
        time.sleep(0.2)


def test_a_restarted_tier_on_the_same_port_is_used_again_within_a_second(
    tier: TierProcess,
) -> None:
    """Negative control: a client with gRPC's default backoff still fails fast then."""
    defaults = [
        ("grpc.initial_reconnect_backoff_ms", 1000),
        ("grpc.min_reconnect_backoff_ms", 20000),
        ("grpc.max_reconnect_backoff_ms", 120000),
    ]
    with (
        TierClient(tier.target, data_path="grpc") as client,
        TierClient(tier.target, data_path="grpc", channel_options=defaults) as slow,
    ):
        assert client.lookup([b"k"]) == slow.lookup([b"k"]) == 0
        tier.kill()
        call_while_down([client, slow], DOWN_S)
        tier.restart()  # same ports

        time.sleep(1.2)

        assert client.put([(b"k", b"v")], timeout_s=0.5) == 1
        assert client.lookup([b"k"], timeout_s=0.5) == 1
        with pytest.raises(TierUnavailable):
            slow.lookup([b"k"], timeout_s=0.5)


def test_channel_options_override_the_clients_own(tier: TierProcess) -> None:
    """An explicit max receive size below a value's size makes its Get fail."""
    with TierClient(tier.target, data_path="grpc") as client:
        client.put([(b"big", bytes(1 << 20))])
    small = [("grpc.max_receive_message_length", 1 << 16)]
    with TierClient(tier.target, data_path="grpc", channel_options=small) as client:
        with pytest.raises(TierRejected, match="RESOURCE_EXHAUSTED"):
            client.get([b"big"])
        assert client.lookup([b"big"]) == 1


@pytest.mark.parametrize("data_path", ["grpc", "data"])
def test_a_rotated_token_file_is_read_again_after_unauthenticated(
    secured: TierProcess, tmp_path: Path, data_path: str
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("stale-token-from-the-old-secret\n")
    with TierClient(secured.target, token_file=str(token_file), data_path=data_path) as client:
        with pytest.raises(TierRejected) as refused:
            client.lookup([b"k"])
        assert refused.value.code == "UNAUTHENTICATED"
        token_file.write_text(f"  {TOKEN}\n")  # the Secret is rotated

        with pytest.raises(TierRejected):  # the refused call is not retried...
            client.put([(b"k", b"v")])
        assert client.put([(b"k", b"v")]) == 1  # ...the next one uses the new token
        assert client.get([b"k"]) == [b"v"]


def test_a_missing_token_file_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"auth_token_file.*cannot read"):
        TierClient("127.0.0.1:1", token_file=str(tmp_path / "absent"))
