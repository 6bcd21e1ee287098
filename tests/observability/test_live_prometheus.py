"""A real Prometheus (Debian's) scrapes a real tier under load; the dashboards' own
hit-rate queries return the rates of the traffic the test sent."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator

import pytest

from kvtier.connector.client import TierClient
from kvtier.testing.queries import concrete, dashboards
from kvtier.testing.servers import Prometheus
from kvtier.testing.tierproc import TierProcess
from tests.observability.conftest import ObsTools

PRESENT, ABSENT = 6, 4  # every call asks for 6 stored keys, then 4 never stored
CALLS_PER_THREAD, THREADS = 40, 4


def _panel_expr(stem: str, title: str, ref: str = "A") -> str:
    (panel,) = [p for p in dashboards()[stem]["panels"] if p["title"] == title]
    (target,) = [t for t in panel["targets"] if t["refId"] == ref]
    expr: str = target["expr"]
    return expr


@pytest.fixture(scope="module")
def prometheus(
    obs_tools: ObsTools, module_tier: TierProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    prom = Prometheus.start(
        tmp_path_factory.mktemp("prometheus"), {"kvtier": module_tier.metrics_url}, binary=obs_tools.prometheus
    )
    yield prom
    prom.stop()


@pytest.fixture(scope="module")
def traffic(prometheus: Prometheus, module_tier: TierProcess) -> float:
    """Sends the load while Prometheus scrapes; returns the seconds since the last idle scrape."""
    keys = [os.urandom(32) for _ in range(PRESENT + ABSENT)]
    with TierClient(module_tier.target, timeout_s=10) as client:
        assert client.put([(k, os.urandom(64 << 10)) for k in keys[:PRESENT]]) == PRESENT
    # Two scrapes of the counters before any Lookup or Get: the rate window starts at zero.
    prometheus.wait_scraped('kvtier_server_lookup_keys_total == 0 and on() kvtier_tier_hits_total{tier="ram"} == 0')
    time.sleep(2.5)
    started = time.time() - 1.5

    def load() -> None:
        with TierClient(module_tier.target, timeout_s=10) as client:
            for _ in range(CALLS_PER_THREAD):
                assert client.lookup(keys) == PRESENT
                values = client.get(keys, stop_at_first_miss=False)
                assert [v is not None for v in values] == [True] * PRESENT + [False] * ABSENT

    threads = [threading.Thread(target=load) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    calls = CALLS_PER_THREAD * THREADS
    prometheus.wait_scraped(f"kvtier_server_lookup_keys_total == {calls * (PRESENT + ABSENT)}")
    prometheus.wait_scraped(f'kvtier_tier_misses_total{{tier="disk"}} == {calls * ABSENT}')
    return time.time() - started


def _at_now(prometheus: Prometheus, expr: str, window_s: float) -> dict[str, float]:
    window = f"{math.ceil(window_s)}s"
    result = prometheus.query(concrete(expr, rate_interval=window))
    return {",".join(r["metric"].values()): float(r["value"][1]) for r in result}


def test_chunk_hit_rate_panel_returns_the_share_of_keys_the_tier_held(
    prometheus: Prometheus, traffic: float
) -> None:
    expr = _panel_expr("kvtier-overview", "Chunk hit rate (Lookup)")
    assert _at_now(prometheus, expr, traffic) == {"": pytest.approx(PRESENT / (PRESENT + ABSENT), abs=1e-9)}


def test_get_hit_rate_per_tier_panel_returns_each_tiers_share(prometheus: Prometheus, traffic: float) -> None:
    # RAM holds the 6 stored keys; the 4 others miss in RAM, then in disk.
    expr = _panel_expr("kvtier-overview", "Get hit rate per tier")
    assert _at_now(prometheus, expr, traffic) == {
        "ram": pytest.approx(PRESENT / (PRESENT + ABSENT), abs=1e-9),
        "disk": 0.0,
    }


def test_tier_bytes_out_panel_returns_the_bytes_sent(prometheus: Prometheus, traffic: float) -> None:
    expr = _panel_expr("kvtier-overview", "Tier bytes in and out", "B")
    window = math.ceil(traffic) + 30
    at = time.time()
    (result,) = prometheus.query(concrete(expr, rate_interval=f"{window}s"), at=at)
    rate = float(result["value"][1])
    sent = CALLS_PER_THREAD * THREADS * PRESENT * (64 << 10)
    # rate() is the increase between the window's first and last samples, extrapolated:
    # not before the first (the counter starts at zero there), and past the last by at
    # most 1.1 average scrape intervals. The series may be younger than the window, so
    # the bound comes from its samples (under load, scrapes come late and the series'
    # span is a few intervals: a fixed 15 % was exceeded on a loaded machine).
    (series,) = prometheus.query(f"kvtier_server_sent_bytes_total[{window}s]", at=at)
    stamps = [float(t) for t, _ in series["values"]]
    span = stamps[-1] - stamps[0]
    interval = span / (len(stamps) - 1)
    assert sent <= rate * window <= sent * (span + 1.1 * interval) / span * 1.001


def test_lookup_ratio_over_the_whole_window_is_independent_of_the_scrape_timing(
    prometheus: Prometheus, traffic: float
) -> None:
    """A wider window (idle scrapes on both sides) gives the same ratio: rates, not totals."""
    expr = _panel_expr("kvtier-overview", "Chunk hit rate (Lookup)")
    assert _at_now(prometheus, expr, traffic + 30) == {"": pytest.approx(0.6, abs=1e-9)}
