"""Real scrapes: a running tier and a running vLLM server with the connector.

Their /metrics pass ``promtool check metrics``, and every metric name (and every
label a panel groups by) that a dashboard panel, a dashboard variable or an alert
uses is in them: no panel can show "No Data" because of a name.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator

import pytest

from kvtier.testing.queries import (
    ROOT,
    SYNTHETIC,
    TARGET_LABELS,
    dashboards,
    exprs,
    grouped_labels,
    selectors,
)
from kvtier.testing.servers import VllmServer
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import build_vl_model, prompt_text

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL_NAME = "tiny-qwen2"


@pytest.fixture(scope="module")
def engine(module_tier: TierProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    work = tmp_path_factory.mktemp("vllm")
    # A multimodal model, so the encoder-cache connector's series are scraped too.
    model = build_vl_model(work / "model")
    server = VllmServer.start(
        model, work / "server", module_tier.target, model_name=MODEL_NAME, encoder_cache=True
    )
    try:
        text = prompt_text(600, seed=11)
        server.complete(text)  # computed and saved
        deadline = time.monotonic() + 60
        while "kvtier_connector_loaded_chunks_total{" not in server.metrics():
            assert time.monotonic() < deadline, "the repeat never loaded from the tier"
            server.complete(text)  # loaded once the background save landed
            time.sleep(0.5)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def scrapes(engine: VllmServer, module_tier: TierProcess) -> dict[str, str]:
    return {"tier": module_tier.metrics(), "vllm": engine.metrics()}


def _families(text: str) -> dict[str, str]:
    """Family name -> type, from the # TYPE lines."""
    return {m[0]: m[1] for m in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)}


def _series_names(text: str) -> set[str]:
    """Every name a query can use: sample names, and the names of declared families
    (a labelled counter is declared before its first sample: ``_total``, histograms'
    ``_bucket``/``_count``/``_sum``)."""
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for family, kind in _families(text).items():
        names.add(family)
        if kind == "counter":
            names.add(family if family.endswith("_total") else family + "_total")
        if kind == "histogram":
            names |= {family + "_bucket", family + "_count", family + "_sum"}
    return names


def _labels_of(text: str, name: str) -> set[str] | None:
    """Label names on the samples of ``name`` (None when it has no sample yet)."""
    found = None
    for line in text.splitlines():
        series = line.rpartition(" ")[0]
        if series == name or series.startswith(name + "{"):
            found = (found or set()) | set(re.findall(r'(\w+)="', series.partition("{")[2]))
    return found


def _promtool_check(promtool: str, text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)


def _only(text: str, prefix: str) -> str:
    """The exposition restricted to the families whose name starts with ``prefix``."""
    keep, out = False, []
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            keep = line.split()[2].startswith(prefix)
        elif not line.startswith("#"):
            keep = line.startswith(prefix)
        if keep:
            out.append(line)
    return "\n".join(out) + "\n"


def test_tier_metrics_pass_promtool_check_metrics(promtool: str, scrapes: dict[str, str]) -> None:
    result = _promtool_check(promtool, scrapes["tier"])
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_connector_metrics_on_vllm_pass_promtool_check_metrics(promtool: str, scrapes: dict[str, str]) -> None:
    result = _promtool_check(promtool, _only(scrapes["vllm"], "kvtier_"))
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_vllm_metrics_parse_and_only_vllms_own_names_draw_lint(promtool: str, scrapes: dict[str, str]) -> None:
    """vLLM names its series ``vllm:*`` (colons are for recording rules, says the lint):
    vLLM's choice, not ours. Everything else on its /metrics is clean."""
    result = _promtool_check(promtool, scrapes["vllm"])
    assert result.returncode in (0, 3), result.stderr  # 3: lint findings only, no parse error
    problems = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert [p for p in problems if not p.startswith("vllm:")] == []


def test_every_metric_name_in_dashboards_and_alerts_is_in_the_scrapes(scrapes: dict[str, str]) -> None:
    scraped = _series_names(scrapes["tier"]) | _series_names(scrapes["vllm"])
    used = {s.name for _, expr in exprs() for s in selectors(expr)}
    for dashboard in dashboards().values():
        for variable in dashboard["templating"]["list"]:
            if variable["type"] == "query":
                used |= {s.name for s in selectors(variable["query"]["query"])}
    assert "kvtier_connector_hit_tokens_total" in used and "kvtier_tier_hits_total" in used
    assert sorted(used - scraped - SYNTHETIC) == []


def test_every_label_a_query_filters_or_groups_by_is_on_the_scraped_series(scrapes: dict[str, str]) -> None:
    text = scrapes["tier"] + scrapes["vllm"]
    missing = []
    for where, expr in exprs():
        uses = [(s.labels, [s]) for s in selectors(expr)] + grouped_labels(expr)
        for labels, sels in uses:
            for sel in sels:
                have = _labels_of(text, sel.name)
                if have is None:  # no sample yet (an error counter): the name check covers it
                    continue
                missing += [f"{where}: {sel.name} has no label {label!r}" for label in labels - have - TARGET_LABELS]
    assert missing == []


def test_the_connector_series_carry_the_served_model_name(scrapes: dict[str, str]) -> None:
    line = next(x for x in scrapes["vllm"].splitlines() if x.startswith("kvtier_connector_hit_tokens_total{"))
    assert f'model_name="{MODEL_NAME}"' in line
    assert float(line.rpartition(" ")[2]) >= 512  # the repeat's full chunks came from the tier


def test_every_metric_the_tier_exports_is_a_row_of_the_docs_tier_table(scrapes: dict[str, str]) -> None:
    doc = (ROOT / "docs" / "observability.md").read_text()
    table = doc.split("### The cache tier", 1)[1].split("\n### ", 1)[0]
    rows = set(re.findall(r"^\| `(kvtier_\w+)` \|", table, re.M))
    exported = set()
    for family, kind in _families(scrapes["tier"]).items():
        # prometheus_client adds a <counter>_created gauge beside each unlabelled counter
        if family.startswith("kvtier_") and not family.endswith("_created"):
            exported.add(family + "_total" if kind == "counter" and not family.endswith("_total") else family)
    assert exported, "the tier's scrape has no kvtier_ family"
    assert sorted(exported - rows) == []
