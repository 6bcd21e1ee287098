"""status.traffic: reading /metrics pages (real HTTP servers on 127.0.0.1) and summing them.

The engine pages are the connector's own series (``kvtier.connector.metrics.PromSeries``)
exposed by prometheus_client, as vLLM exposes them; tier pages are those of a real
``kvtier server`` in test_on_apiserver.py, and hand-written here where a tier must fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import math
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtier.connector.metrics import PromSeries
from kvtier.operator.handlers import same_status
from kvtier.operator.promtext import MetricsFormatError, parse, total
from kvtier.operator.scrape import MetricsReader, PodAddress, ready_pods
from kvtier.operator.traffic import engine_summary, tier_summary


class EnginePage:
    """The kvtier connector's series in a registry of their own, as vLLM's /metrics has them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        with_registry = functools.partial
        self.series = PromSeries(
            with_registry(Counter, registry=self.registry),
            with_registry(Histogram, registry=self.registry),
            ["model_name", "engine"],
            gauge_cls=with_registry(_Gauge, registry=self.registry),
        )
        self.series.initialize(["google/gemma-3-4b-it", 0])

    def traffic(self, lookups: int, hits: int, tokens: int, engine: int = 0) -> None:
        counters = {"lookup_chunks": lookups, "lookup_hit_chunks": hits, "hit_tokens": tokens}
        self.series.observe({"counters": counters}, ["google/gemma-3-4b-it", engine])

    def text(self) -> str:
        return generate_latest(self.registry).decode()


class _Gauge(Gauge):
    def __init__(self, *args: Any, multiprocess_mode: str = "all", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # vLLM's gauge class takes a multiprocess mode


TIER_PAGE = """# HELP kvtier_server_lookup_keys_total Keys asked about.
# TYPE kvtier_server_lookup_keys_total counter
kvtier_server_lookup_keys_total {lookups}
kvtier_server_lookup_hit_keys_total {hits}
kvtier_server_serving 1
kvtier_tier_healthy{{tier="ram"}} 1
kvtier_tier_healthy{{tier="disk"}} 1
kvtier_tier_healthy{{tier="redis"}} {redis}
kvtier_tier_used_bytes{{tier="ram"}} 100
kvtier_tier_used_bytes{{tier="disk"}} 1000
kvtier_tier_used_bytes{{tier="redis"}} 5000
kvtier_tier_capacity_bytes{{tier="ram"}} 1024
kvtier_tier_capacity_bytes{{tier="disk"}} 4096
kvtier_tier_capacity_bytes{{tier="redis"}} 0
"""


def tier_page(lookups: int, hits: int, redis: int = 1) -> list[Any]:
    return parse(TIER_PAGE.format(lookups=lookups, hits=hits, redis=redis))


def pods(*names: str) -> list[PodAddress]:
    return [PodAddress(name, f"10.0.0.{i}") for i, name in enumerate(names, start=1)]


def test_a_page_is_read_into_samples_with_labels_escapes_and_special_values() -> None:
    samples = parse(
        '# HELP x A counter.\n# TYPE x counter\n\n'
        'x_total{a="1",b="with \\"quotes\\", a comma} and \\\\ a backslash"} 3.5 1700000000\n'
        'y NaN\nz +Inf\nw{le="0.1",} 2\n'
    )  # fmt: skip
    assert (samples[0].name, dict(samples[0].labels)) == (
        "x_total", {"a": "1", "b": 'with "quotes", a comma} and \\ a backslash'},
    )  # fmt: skip
    assert samples[0].value == 3.5
    assert math.isnan(samples[1].value) and samples[2].value == math.inf
    assert samples[3].labels == {"le": "0.1"}
    assert total(samples, "y") is None  # a NaN is no data
    assert total(samples, "absent") is None


@pytest.mark.parametrize("line", ["x{a=1} 2", "x 2 3 4", 'x{a="1"}', "x one", "<html>"])
def test_a_line_that_is_not_a_sample_refuses_the_whole_page_naming_the_line(line: str) -> None:
    with pytest.raises(MetricsFormatError, match=r"^line 2: "):
        parse(f"ok 1\n{line}\n")


def test_the_connectors_series_sum_over_every_engine_of_a_page() -> None:
    page = EnginePage()
    page.traffic(lookups=10, hits=4, tokens=1024, engine=0)
    page.traffic(lookups=6, hits=6, tokens=1536, engine=1)  # a second engine core (DP)
    samples = parse(page.text())
    assert total(samples, "kvtier_connector_lookup_chunks_total") == 16
    assert total(samples, "kvtier_connector_lookup_hit_chunks_total") == 10
    assert total(samples, "kvtier_connector_hit_tokens_total") == 2560


def test_a_recipes_traffic_sums_its_engines_and_quotes_the_tiers_state() -> None:
    first, second = EnginePage(), EnginePage()
    first.traffic(lookups=8, hits=6, tokens=1536)
    second.traffic(lookups=2, hits=0, tokens=0)
    pages = {"qwen-a": parse(first.text()), "qwen-b": parse(second.text())}
    summary = engine_summary(pods("qwen-a", "qwen-b"), pages, "Serving")
    assert summary == {
        "state": "Known", "engines": 2, "enginesReporting": 2, "lookupChunks": 10,
        "hitChunks": 6, "chunkHitRate": 0.6, "tokensServed": 1536, "tierState": "Serving",
        "message": None,
    }  # fmt: skip


def test_engines_that_do_not_answer_are_left_out_and_named() -> None:
    page = EnginePage()
    page.traffic(lookups=4, hits=1, tokens=256)
    pages = {"a": parse(page.text()), "b": "no answer within 2 s", "c": parse("vllm_up 1\n")}
    summary = engine_summary(pods("a", "b", "c"), pages, "Unknown")
    assert (summary["state"], summary["enginesReporting"], summary["chunkHitRate"]) == (
        "Partial", 1, 0.25,
    )  # fmt: skip
    assert summary["message"] == (
        "metrics of 2/3 engine pods unknown (b: no answer within 2 s; "
        "c: no kvtier connector series (is the connector configured?))"
    )


def test_without_an_answer_the_numbers_are_unknown_not_zero() -> None:
    summary = engine_summary(pods("a"), {"a": "ClientConnectorError"}, "Serving")
    assert summary["state"] == "Unknown"
    assert summary["lookupChunks"] is summary["chunkHitRate"] is summary["tokensServed"] is None
    assert engine_summary([], {}, "Serving")["message"] == "no ready engine pods"


def test_a_rate_is_left_out_until_the_first_lookup() -> None:
    page = EnginePage()  # every series at zero
    summary = engine_summary(pods("a"), {"a": parse(page.text())}, "Serving")
    assert (summary["lookupChunks"], summary["chunkHitRate"]) == (0, None)


def test_a_tier_serves_when_every_replica_is_ready_and_every_storage_tier_healthy() -> None:
    pages = {"t-0": tier_page(10, 5), "t-1": tier_page(30, 25)}
    state, traffic = tier_summary(2, pods("t-0", "t-1"), pages, metrics=True)
    assert state == "Serving"
    assert (traffic["lookupChunks"], traffic["hitChunks"], traffic["chunkHitRate"]) == (
        40,
        30,
        0.75,
    )
    # RAM and disk are each replica's own: summed; Redis is shared: counted once.
    assert traffic["storage"] == [
        {"tier": "ram", "healthy": True, "usedBytes": 200, "capacityBytes": 2048},
        {"tier": "disk", "healthy": True, "usedBytes": 2000, "capacityBytes": 8192},
        {"tier": "redis", "healthy": True, "usedBytes": 5000, "capacityBytes": 0},
    ]
    assert traffic["state"] == "Known" and traffic["message"] == "2/2 replicas ready"


def test_a_failing_redis_or_a_missing_replica_degrades_the_tier_and_none_ready_is_down() -> None:
    state, traffic = tier_summary(
        2, pods("t-0", "t-1"), {"t-0": tier_page(1, 1), "t-1": tier_page(1, 1, redis=0)},
        metrics=True,
    )  # fmt: skip
    assert state == "Degraded" and "failing: redis" in traffic["message"]
    assert tier_summary(2, pods("t-0"), {"t-0": tier_page(1, 1)}, metrics=True)[0] == "Degraded"
    assert tier_summary(2, [], {}, metrics=True)[0] == "Down"


def test_a_tier_without_metrics_is_judged_by_readiness_alone() -> None:
    state, traffic = tier_summary(1, pods("t-0"), {}, metrics=False)
    assert (state, traffic["state"], traffic["storage"]) == ("Serving", "Unknown", None)
    assert "metrics are off" in traffic["message"]


def test_only_ready_pods_with_an_ip_that_are_not_being_deleted_are_read() -> None:
    def pod(name: str, ready: str = "True", ip: str | None = "10.0.0.1", **meta: Any) -> Any:
        status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": ready}]}
        if ip:
            status["podIP"] = ip
        return {"metadata": {"name": name, **meta}, "status": status}

    listed = [pod("b"), pod("a"), pod("c", ready="False"), pod("d", ip=None),
              pod("e", deletionTimestamp="2026-01-01T00:00:00Z")]  # fmt: skip
    assert [p.name for p in ready_pods(listed)] == ["a", "b"]


def test_a_status_that_only_adds_nones_is_the_same_and_a_new_number_is_not() -> None:
    before = {"traffic": {"state": "Unknown", "engines": 1}}
    assert same_status(
        before, {"traffic": {"state": "Unknown", "engines": 1, "chunkHitRate": None}}
    )
    assert not same_status(before, {"traffic": {"state": "Known", "engines": 1}})


class _Pages(http.server.BaseHTTPRequestHandler):
    pages: ClassVar[dict[str, tuple[int, bytes]]] = {}
    piece: ClassVar[int] = 0  # > 0: the body in pieces of this size, a pause between them

    def do_GET(self) -> None:
        status, body = self.pages.get(self.path, (404, b"not found"))
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        if not self.piece:
            self.wfile.write(body)
            return
        for start in range(0, len(body), self.piece):
            self.wfile.write(body[start : start + self.piece])
            self.wfile.flush()
            time.sleep(0.02)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serving(pages: dict[str, tuple[int, bytes]], piece: int = 0) -> Iterator[int]:
    handler = type("Pages", (_Pages,), {"pages": pages, "piece": piece})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


async def test_the_reader_reads_pages_and_says_why_it_could_not() -> None:
    engine = EnginePage()
    engine.traffic(lookups=2, hits=1, tokens=256)
    pages = {"/metrics": (200, engine.text().encode())}
    with serving(pages) as good, serving({"/metrics": (200, b"<html>nope</html>")}) as html, \
            serving({}) as missing:  # fmt: skip
        reader = MetricsReader(timeout_s=2)
        try:
            read = await reader.read_all(
                [PodAddress(f"p{port}", "127.0.0.1") for port in (good,)], good
            )
            assert total(read[f"p{good}"], "kvtier_connector_hit_tokens_total") == 256  # type: ignore[arg-type]
            assert await reader.read(f"http://127.0.0.1:{missing}/metrics") == "HTTP 404"
            bad = await reader.read(f"http://127.0.0.1:{html}/metrics")
            assert isinstance(bad, str) and bad.startswith("not Prometheus metrics (line 1")
        finally:
            await reader.close()


async def test_a_page_that_arrives_in_pieces_is_read_whole() -> None:
    engine = EnginePage()
    engine.traffic(lookups=2, hits=1, tokens=256)
    text = engine.text() + "".join(f'filler_total{{i="{i}"}} 1.0\n' for i in range(2000))
    with serving({"/metrics": (200, text.encode())}, piece=4096) as port:
        reader = MetricsReader(timeout_s=10)
        try:
            page = await reader.read(f"http://127.0.0.1:{port}/metrics")
        finally:
            await reader.close()
    assert not isinstance(page, str), page
    assert total(page, "filler_total") == 2000
    assert total(page, "kvtier_connector_hit_tokens_total") == 256


async def test_a_pod_that_never_answers_costs_one_timeout_for_all_pods_read_together() -> None:
    reader = MetricsReader(timeout_s=1)
    try:
        with silent_port() as port:
            closed = socket.socket()
            closed.bind(("127.0.0.1", 0))
            refused = closed.getsockname()[1]
            closed.close()  # nothing listens there any more
            started = time.monotonic()
            silent = [reader.read(f"http://127.0.0.1:{port}/metrics") for _ in range(4)]
            *results, failed = await asyncio.gather(
                *silent, reader.read(f"http://127.0.0.1:{refused}/metrics")
            )
            elapsed = time.monotonic() - started
        assert results == ["no answer within 1 s"] * 4
        assert isinstance(failed, str) and "Connect" in failed
        assert elapsed < 3  # one timeout for the pods read together, not 4 in a row
    finally:
        await reader.close()
