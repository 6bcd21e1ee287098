"""The connector's metrics: the breaker gauge through Recorder -> merge -> PromSeries, with
real prometheus_client classes (as vLLM hands them over)."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtier.connector import metrics


def series(registry: CollectorRegistry) -> metrics.PromSeries:
    return metrics.PromSeries(
        functools.partial(Counter, registry=registry),
        functools.partial(Histogram, registry=registry),
        ["model_name", "engine"],
        gauge_cls=functools.partial(Gauge, registry=registry),
    )


def scrape(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_a_gauge_is_reported_with_every_take_until_changed() -> None:
    recorder = metrics.Recorder()
    assert recorder.take() is None
    recorder.set("breaker_open", 1)
    assert recorder.take() == {"counters": {}, "histograms": {}, "gauges": {"breaker_open": 1}}
    assert recorder.take() == {"counters": {}, "histograms": {}, "gauges": {"breaker_open": 1}}
    recorder.set("breaker_open", 0)
    assert (recorder.take() or {})["gauges"] == {"breaker_open": 0}


def test_merging_halves_keeps_the_open_breaker() -> None:
    """The scheduler's breaker is open, a worker's is closed: the step says open."""
    merged = metrics.empty()
    metrics.merge(merged, {"gauges": {"breaker_open": 0}, "counters": {"lookups": 1}})
    metrics.merge(merged, {"gauges": {"breaker_open": 1}})
    metrics.merge(merged, {"gauges": {"breaker_open": 0}})
    assert merged["gauges"] == {"breaker_open": 1}
    assert metrics.summarize(merged)["breaker_open"] == 1


def test_the_breaker_gauge_is_exported_per_model_and_follows_the_last_step() -> None:
    registry = CollectorRegistry()
    prom = series(registry)
    prom.observe({"gauges": {"breaker_open": 1}, "counters": {"lookups": 2}}, ["m", "0"])
    assert 'kvtier_connector_breaker_open{engine="0",model_name="m"} 1.0' in scrape(registry)
    prom.observe({"gauges": {"breaker_open": 0}}, ["m", "0"])
    text = scrape(registry)
    assert 'kvtier_connector_breaker_open{engine="0",model_name="m"} 0.0' in text
    assert 'kvtier_connector_lookups_total{engine="0",model_name="m"} 2.0' in text


def test_corrupt_chunks_are_counted_by_reason() -> None:
    registry = CollectorRegistry()
    prom = series(registry)
    recorder = metrics.Recorder()
    recorder.count("corrupt_chunks", label="checksum")
    recorder.count("corrupt_chunks", label="codec")
    recorder.count("corrupt_chunks", label="checksum")
    prom.observe(recorder.take() or {}, ["m", "0"])
    text = scrape(registry)
    assert 'kvtier_connector_corrupt_chunks_total{engine="0",model_name="m",reason="checksum"} 2.0' in text
    assert 'kvtier_connector_corrupt_chunks_total{engine="0",model_name="m",reason="codec"} 1.0' in text


def test_without_a_gauge_class_no_gauge_is_created() -> None:
    """The encoder-cache connector builds its series without gauges (backwards compatible)."""
    registry = CollectorRegistry()
    prom = metrics.PromSeries(
        functools.partial(Counter, registry=registry),
        functools.partial(Histogram, registry=registry),
        ["model_name"],
    )
    prom.observe({"gauges": {"breaker_open": 1}}, ["m"])
    assert "kvtier_connector_breaker_open " not in scrape(registry)
    assert "kvtier_connector_breaker_open{" not in scrape(registry)


def test_every_connector_series_and_its_label_is_documented() -> None:
    """docs/observability.md has a row per series (KV and encoder cache) naming its label,
    and every verification-failure reason."""
    from pathlib import Path

    from kvtier.connector.errors import CHUNK_ERROR_REASONS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()
    rows = {line.split("`")[1]: line for line in doc.splitlines() if line.startswith("| `kvtier_")}
    expected: dict[str, str | None] = {}
    for series in (metrics.KV, metrics.EC):
        prefix = series.prefix
        expected |= {f"{prefix}{name}_total": label for name, (_, label) in series.counters.items()}
        expected |= {prefix + name: None for name in (*series.histograms, *series.gauges)}
    assert sorted(set(expected) - set(rows)) == []
    for name, label in expected.items():
        cells = rows[name].split("|")
        assert (f"`{label}`" in cells[3]) if label else not cells[3].strip(), name
    reasons = rows["kvtier_connector_corrupt_chunks_total"]
    assert [r for r in CHUNK_ERROR_REASONS if r not in reasons] == []
