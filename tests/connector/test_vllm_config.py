"""kv_connector_extra_config parsing and the circuit breaker (no engine needed)."""

from __future__ import annotations

import pytest

from kvtier.connector.breaker import BreakerState, CircuitBreaker
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.errors import ConfigError


def test_config_defaults_need_only_a_target() -> None:
    config = ConnectorConfig.from_extra_config({"target": "127.0.0.1:50051"})
    assert config.chunk_size == 256
    assert config.salt_policy == "request"
    assert config.lookup_timeout_s > 0 and config.load_timeout_s > 0


def test_config_without_target_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.target is required"):
        ConnectorConfig.from_extra_config({})


def test_config_rejects_unknown_key_and_lists_accepted_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown .*'chunksize'.*accepted: .*chunk_size"):
        ConnectorConfig.from_extra_config({"target": "h:1", "chunksize": 256})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("chunk_size", 0),
        ("chunk_size", "256"),
        ("chunk_size", True),
        ("lookup_timeout_s", 0),
        ("load_timeout_s", float("inf")),
        ("save_queue_chunks", -1),
        ("breaker_failures", 0),
        ("salt_policy", "sometimes"),
        ("hash_algo", "md5"),
        ("target", "no-port"),
    ],
)
def test_config_rejects_bad_value_naming_the_key(key: str, value: object) -> None:
    extra = {"target": "127.0.0.1:1", key: value}
    with pytest.raises(ConfigError, match=rf"kv_connector_extra_config\.{key}"):
        ConnectorConfig.from_extra_config(extra)


def test_chunk_size_not_a_multiple_of_block_size_suggests_one() -> None:
    config = ConnectorConfig.from_extra_config({"target": "h:1", "chunk_size": 300})
    with pytest.raises(
        ConfigError, match=r"chunk_size=300 must be a multiple .* 128.*use e\.g\. 256 or 384"
    ):
        config.check_block_size(128)
    config.check_block_size(4)  # 300 = 75 blocks of 4


def test_token_env_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_TOKEN", "s3cret")
    config = ConnectorConfig.from_extra_config({"target": "h:1", "token_env": "KVTIER_TEST_TOKEN"})
    assert config.token == "s3cret"


def test_token_env_unset_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_TEST_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="token_env"):
        ConnectorConfig.from_extra_config({"target": "h:1", "token_env": "KVTIER_TEST_TOKEN"})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures() -> None:
    opened = []
    breaker = CircuitBreaker(3, 5.0, clock=Clock(), on_open=lambda: opened.append(1))
    for _ in range(2):
        assert breaker.allow()
        breaker.failure()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow()
    breaker.failure()
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allow()
    assert opened == [1]


def test_breaker_success_resets_the_failure_count() -> None:
    breaker = CircuitBreaker(2, 5.0, clock=Clock())
    breaker.failure()
    breaker.success()
    breaker.failure()
    assert breaker.state is BreakerState.CLOSED


def test_breaker_lets_one_probe_through_after_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker(1, 5.0, clock=clock)
    breaker.failure()
    clock.now = 4.9
    assert not breaker.allow()
    clock.now = 5.0
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # nobody else while it is out
    breaker.success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow()


def test_breaker_failed_probe_reopens_for_another_cooldown() -> None:
    clock = Clock()
    opened = []
    breaker = CircuitBreaker(1, 5.0, clock=clock, on_open=lambda: opened.append(1))
    breaker.failure()
    clock.now = 5.0
    assert breaker.allow()
    breaker.failure()
    assert breaker.state is BreakerState.OPEN
    clock.now = 9.9
    assert not breaker.allow()
    assert opened == [1]  # counted once: closed -> open
