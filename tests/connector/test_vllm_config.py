"""kv_connector_extra_config parsing and the circuit breaker (no engine needed)."""

from __future__ import annotations

import pytest

from kvtier.connector.client.breaker import BreakerState, CircuitBreaker
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
        ("receive_buffer_bytes", -1),
        ("receive_buffer_bytes", "256MiB"),
        ("receive_buffer_bytes", False),
        ("layerwise", "false"),
        ("layerwise", 0),
    ],
)
def test_config_rejects_bad_value_naming_the_key(key: str, value: object) -> None:
    extra = {"target": "127.0.0.1:1", key: value}
    with pytest.raises(ConfigError, match=rf"kv_connector_extra_config\.{key}"):
        ConnectorConfig.from_extra_config(extra)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing vLLM's model stack
def test_layerwise_copies_ask_vllm_for_piecewise_cuda_graphs_unless_turned_off() -> None:
    from kvtier.connector.vllm import KvtierConnector

    assert ConnectorConfig.from_extra_config({"target": "h:1"}).layerwise is True
    assert KvtierConnector.requires_piecewise_for_cudagraph({"target": "h:1"}) is True
    off = {"target": "h:1", "layerwise": False}
    assert ConnectorConfig.from_extra_config(off).layerwise is False
    assert KvtierConnector.requires_piecewise_for_cudagraph(off) is False


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


# -- keys the operator sends ------------------------------------------------------


def test_auth_token_file_is_read_at_start_and_stripped(tmp_path) -> None:
    path = tmp_path / "token"
    path.write_text("  s3cret-token\n")
    config = ConnectorConfig.from_extra_config({"target": "h:1", "auth_token_file": str(path)})
    assert config.token == "s3cret-token"
    assert config.auth_token_file == str(path)
    assert "s3cret" not in repr(config)


@pytest.mark.parametrize("content", [None, "", " \n"], ids=["missing", "empty", "blank"])
def test_an_unusable_auth_token_file_names_the_key(tmp_path, content: str | None) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.auth_token_file"):
        ConnectorConfig.from_extra_config({"target": "h:1", "auth_token_file": str(path)})


@pytest.mark.parametrize("other", [{"token": "t"}, {"token_env": "KVTIER_TEST_TOKEN"}])
def test_auth_token_file_excludes_the_other_token_sources(
    tmp_path, monkeypatch: pytest.MonkeyPatch, other: dict[str, str]
) -> None:
    monkeypatch.setenv("KVTIER_TEST_TOKEN", "s3cret")
    path = tmp_path / "token"
    path.write_text("t")
    extra = {"target": "h:1", "auth_token_file": str(path), **other}
    with pytest.raises(ConfigError, match=r"give one of token, token_env, auth_token_file"):
        ConnectorConfig.from_extra_config(extra)


def test_token_and_token_env_still_exclude_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_TOKEN", "s3cret")
    with pytest.raises(ConfigError, match="not token and token_env"):
        ConnectorConfig.from_extra_config(
            {"target": "h:1", "token": "t", "token_env": "KVTIER_TEST_TOKEN"}
        )


def test_the_operators_keys_are_accepted(tmp_path) -> None:
    """What operator/kvtier/operator/children.py emits: target, chunk_size, codec, salt_policy, salt,
    auth_token_file."""
    path = tmp_path / "token"
    path.write_text("t0ken")
    config = ConnectorConfig.from_extra_config(
        {
            "target": "kvtier-tier.ns.svc:50051",
            "chunk_size": 256,
            "codec": "zstd",
            "salt_policy": "request",
            "salt": "ns",
            "auth_token_file": str(path),
        }
    )
    assert (config.codec, config.salt, config.token) == ("zstd", "ns", "t0ken")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("codec", "none"),
        ("codec", "lz4"),
        ("codec", 1),
        ("salt", ""),
        ("salt", 7),
        ("auth_token_file", ""),
    ],
)
def test_bad_codec_salt_or_token_file_names_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"kv_connector_extra_config\.{key}"):
        ConnectorConfig.from_extra_config({"target": "127.0.0.1:1", key: value})


def test_codec_defaults_to_raw_and_salt_to_none() -> None:
    config = ConnectorConfig(target="h:1")
    assert (config.codec, config.salt, config.auth_token_file) == ("raw", None, None)


def test_tls_files_are_accepted(tmp_path) -> None:
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (tmp_path / name).write_text("PEM")
    files = {"tls_ca_file": "ca.crt", "tls_cert_file": "tls.crt", "tls_key_file": "tls.key"}
    extra = {"target": "h:1", **{key: str(tmp_path / name) for key, name in files.items()}}
    config = ConnectorConfig.from_extra_config(extra)
    assert (config.tls_ca_file, config.tls_cert_file, config.tls_key_file) == tuple(
        str(tmp_path / name) for name in files.values()
    )


def test_a_client_certificate_without_its_key_names_both_keys(tmp_path) -> None:
    (tmp_path / "tls.crt").write_text("PEM")
    with pytest.raises(ConfigError, match="give both tls_cert_file and tls_key_file"):
        ConnectorConfig.from_extra_config(
            {"target": "h:1", "tls_cert_file": str(tmp_path / "tls.crt")}
        )


def test_an_unreadable_tls_file_names_the_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.tls_ca_file: cannot read"):
        ConnectorConfig.from_extra_config({"target": "h:1", "tls_ca_file": str(tmp_path / "none")})
