"""How both vLLM connectors reach the tier (``kvtier.connector.factory``): the same client
settings, breaker, warm-up and stats for the KV and the encoder-cache series, on real
tier processes."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from kvtier.connector import metrics
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.factory import TierLink, connect
from kvtier.testing.redisprocs import free_port
from kvtier.testing.tierproc import TierProcess

MIB = 1 << 20
SERIES = [pytest.param(metrics.KV, id="kv"), pytest.param(metrics.EC, id="encoder-cache")]


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TierProcess]:
    tier = TierProcess.start(tmp_path_factory.mktemp("tier"), "--data-port", str(free_port()))
    yield tier
    tier.stop()


def linked(target: str, series: metrics.Series, **extra: object) -> TierLink:
    return connect(ConnectorConfig.from_extra_config({"target": target, **extra}), series)


@pytest.mark.parametrize("series", SERIES)
@pytest.mark.parametrize(("receive_buffer_bytes", "kept"), [(0, 0), (8 * MIB, 1)])
def test_each_half_receives_into_the_buffers_its_config_allows(
    tier: TierProcess, series: metrics.Series, receive_buffer_bytes: int, kept: int
) -> None:
    link = linked(tier.target, series, receive_buffer_bytes=receive_buffer_bytes)
    try:
        link.client.put([(b"big", os.urandom(2 * MIB))])
        values = link.client.get([b"big"])
        assert link.client.recycle(values) == kept
    finally:
        link.close()


@pytest.mark.parametrize("series", SERIES)
def test_the_warm_up_reaches_the_tier_and_says_so(
    tier: TierProcess, series: metrics.Series, caplog: pytest.LogCaptureFixture
) -> None:
    link = linked(tier.target, series)
    try:
        with caplog.at_level(logging.INFO, logger="kvtier.connector.factory"):
            link.warm_up(ConnectorConfig(target=tier.target), "requests recompute")
        assert f"tier {tier.target} reachable" in caplog.text
        assert link.client.transport == "data"  # the pick is made at start, not by a request
    finally:
        link.close()


@pytest.mark.parametrize("series", SERIES)
def test_a_tier_not_reachable_at_start_is_a_warning_naming_what_the_engine_does(
    series: metrics.Series, caplog: pytest.LogCaptureFixture
) -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens
    link = linked(target, series)
    try:
        link.warm_up(ConnectorConfig(target=target), "encoders run")
    finally:
        link.close()
    (record,) = [r for r in caplog.records if "not reachable at start" in r.getMessage()]
    assert record.levelname == "WARNING"
    assert "encoders run until it is" in record.getMessage()


@pytest.mark.parametrize("series", SERIES)
def test_the_stats_of_every_step_carry_the_breakers_state(series: metrics.Series) -> None:
    link = linked(f"127.0.0.1:{free_port()}", series, breaker_failures=2)
    try:
        assert link.take_stats() == {"counters": {}, "histograms": {}, "gauges": {"breaker_open": 0}}
        link.breaker.failure()
        link.breaker.failure()
        stats = link.take_stats()
        assert stats is not None
        assert stats["gauges"] == {"breaker_open": 1}
        assert stats["counters"] == {"breaker_opened": 1}
        assert link.take_stats() == {"counters": {}, "histograms": {}, "gauges": {"breaker_open": 1}}
    finally:
        link.close()
