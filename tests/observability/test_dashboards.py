"""The dashboards' structure and queries, checked with Grafana's schema and promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvtier.testing.queries import (
    DASHBOARDS,
    ROOT,
    concrete,
    counters_outside_rate,
    dashboards,
    exprs,
    panels,
)
from tests.observability.conftest import ObsTools


def test_every_dashboard_type_checks_against_grafana_schema(obs_tools: ObsTools, tmp_path: Path) -> None:
    shutil.copy(Path(__file__).with_name("dashboard.ts"), tmp_path / "dashboard.ts")
    (tmp_path / "node_modules").symlink_to(obs_tools.grafana_schema_dir / "node_modules")
    for path in DASHBOARDS:
        body = json.dumps(json.loads(path.read_text()), indent=2)
        (tmp_path / f"{path.stem}.ts").write_text(
            "import type { KvtierDashboard } from './dashboard';\n"
            f"export const dashboard: KvtierDashboard = {body};\n"
        )
    tsc = obs_tools.grafana_schema_dir / "node_modules" / ".bin" / "tsc"
    result = subprocess.run(
        [str(tsc), "--noEmit", "--strict", "--skipLibCheck", "--target", "es2022",
         "--module", "esnext", "--moduleResolution", "bundler",
         *sorted(p.name for p in tmp_path.glob("*.ts"))],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_type_check_rejects_an_unknown_panel_option(obs_tools: ObsTools, tmp_path: Path) -> None:
    """The check above has teeth: one stray key in one panel fails it."""
    shutil.copy(Path(__file__).with_name("dashboard.ts"), tmp_path / "dashboard.ts")
    (tmp_path / "node_modules").symlink_to(obs_tools.grafana_schema_dir / "node_modules")
    dashboard = dashboards()["kvtier-overview"]
    dashboard["panels"][1]["options"]["colourMode"] = "value"
    (tmp_path / "bad.ts").write_text(
        "import type { KvtierDashboard } from './dashboard';\n"
        f"export const dashboard: KvtierDashboard = {json.dumps(dashboard)};\n"
    )
    tsc = obs_tools.grafana_schema_dir / "node_modules" / ".bin" / "tsc"
    result = subprocess.run(
        [str(tsc), "--noEmit", "--strict", "--skipLibCheck", "--target", "es2022",
         "--module", "esnext", "--moduleResolution", "bundler", "bad.ts"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert "colourMode" in result.stdout


def test_every_expression_passes_promtool_check_rules(promtool: str, tmp_path: Path) -> None:
    """Each panel query (Grafana variables filled in) and alert expr, as a recording rule."""
    recorded = [
        {"record": f"kvtier_check:expr_{i}", "expr": concrete(expr)} for i, (_, expr) in enumerate(exprs())
    ]
    rule_file = tmp_path / "exprs.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "exprs", "rules": recorded}]}))
    result = subprocess.run([promtool, "check", "rules", str(rule_file)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(recorded)} rules found" in result.stdout


def test_no_query_reads_a_counter_as_an_all_time_total() -> None:
    offenders = {where: bad for where, expr in exprs() if (bad := counters_outside_rate(expr))}
    assert offenders == {}


def test_every_hit_rate_panel_divides_rates_of_hits_by_rates_of_lookups() -> None:
    hit_rate_panels = [p for _, p in panels() if p["fieldConfig"]["defaults"]["unit"] == "percentunit"]
    assert len(hit_rate_panels) >= 6
    for panel in hit_rate_panels:
        for target in panel["targets"]:
            assert re.search(r"rate\([^)]*\)\)?\s*/", target["expr"]), panel["title"]


def test_overview_shows_what_the_issue_asks_for() -> None:
    titles = {p["title"] for p in dashboards()["kvtier-overview"]["panels"]}
    assert {
        "Token hit rate per model",
        "Chunk hit rate",
        "Chunk hit rate per model",
        "Get hit rate per tier",
        "Prefill tokens served from cache per model",
        "Connector bytes loaded and saved",
        "Connector load / save / lookup latency",
        "Bytes used and capacity per tier",
        "Evictions per tier",
        "Verification failures",
        "Tier pods serving",
    } <= titles


@pytest.mark.parametrize("stem", [p.stem for p in DASHBOARDS])
def test_panels_have_unique_ids_and_do_not_overlap(stem: str) -> None:
    dashboard = dashboards()[stem]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


@pytest.mark.parametrize("stem", [p.stem for p in DASHBOARDS])
def test_every_query_uses_the_datasource_variable_and_the_namespace_filter(stem: str) -> None:
    for panel in dashboards()[stem]["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert 'namespace=~"$namespace"' in target["expr"], panel["title"]


def test_the_recipe_dashboard_filters_every_connector_query_by_model() -> None:
    for panel in dashboards()["kvtier-recipe"]["panels"]:
        for target in panel.get("targets", []):
            assert 'model_name=~"$model"' in target["expr"], panel["title"]


def test_every_panel_and_alert_is_documented() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text()
    from kvtier.testing.queries import rules

    missing = [p["title"] for _, p in panels() if f"**{p['title']}**" not in doc]
    missing += [r["alert"] for r in rules() if f"`{r['alert']}`" not in doc]
    assert missing == []
