"""The PromQL that kvtier's dashboards and alerts run, as data the tests can check.

- ``panels()``: every dashboard panel with queries, ``exprs()``: (where, expr) pairs
  of every panel target and alert rule.
- ``concrete(expr)``: the expression with Grafana's variables replaced, so
  Prometheus and promtool accept it (``$__rate_interval`` -> a duration,
  ``$namespace``/``$model`` -> ``.*``, i.e. "All").
- ``selectors(expr)``/``grouped_labels(expr)``: the metric names (with their
  label matchers) and the ``by (...)`` labels applied to them. Every kvtier and
  vLLM metric name has a distinctive prefix, so a regular expression finds them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_FILES = ROOT / "helm" / "kvtier" / "files"
DASHBOARDS = sorted((CHART_FILES / "dashboards").glob("*.json"))
RULE_FILES = sorted((CHART_FILES / "rules").glob("*.yaml"))

# Labels Prometheus adds to every series it scrapes (target labels), not the exporter.
TARGET_LABELS = {"namespace", "pod", "job", "instance", "container", "service", "endpoint"}
# Series Prometheus makes itself, never on an exporter's /metrics.
SYNTHETIC = {"up"}

_NAME = re.compile(r"(?<![\w:])(kvtier_[a-z0-9_]+|vllm:[a-z0-9_:]+|up)(?![\w:(])(\{[^}]*\})?")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_BY = re.compile(r"\bby\s*\(([^)]*)\)\s*\(")
_COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


@dataclass(frozen=True)
class Selector:
    name: str
    labels: frozenset[str]  # label names in its matchers


def dashboards() -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in DASHBOARDS}


def rules() -> list[dict[str, Any]]:
    return [rule for path in RULE_FILES for g in yaml.safe_load(path.read_text())["groups"] for rule in g["rules"]]


def panels() -> Iterator[tuple[str, dict[str, Any]]]:
    """(dashboard file stem, panel) for every panel that runs queries."""
    for stem, dashboard in dashboards().items():
        for panel in dashboard["panels"]:
            if panel.get("targets"):
                yield stem, panel


def exprs() -> list[tuple[str, str]]:
    """(where, expr) for every dashboard target and alert rule."""
    out = [
        (f"{stem} panel {panel['id']} {panel['title']!r} {target['refId']}", target["expr"])
        for stem, panel in panels()
        for target in panel["targets"]
    ]
    out += [(f"alert {rule['alert']}", rule["expr"]) for rule in rules()]
    return out


def concrete(expr: str, rate_interval: str = "1m", range_: str = "1h") -> str:
    """``expr`` with Grafana's variables replaced (all values selected)."""
    out = expr.replace("$__rate_interval", rate_interval).replace("$__range", range_)
    out = out.replace("$__interval", rate_interval)
    out = re.sub(r"\$\{?\w+\}?", ".*", out)
    assert "$" not in out, out
    return out


def selectors(expr: str) -> list[Selector]:
    found = []
    for match in _NAME.finditer(expr):
        matchers = match.group(2) or ""
        found.append(Selector(match.group(1), frozenset(_MATCHER.findall(matchers))))
    return found


def _group(expr: str, open_at: int) -> str:
    """The text inside the parenthesis that opens at ``open_at``."""
    depth = 0
    for i in range(open_at, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[i], 0)
        if depth == 0:
            return expr[open_at + 1 : i]
    raise ValueError(f"unbalanced parentheses in {expr!r}")


def grouped_labels(expr: str) -> list[tuple[frozenset[str], list[Selector]]]:
    """For each ``by (labels) (...)``: the labels, and the selectors aggregated."""
    out = []
    for match in _BY.finditer(expr):
        labels = frozenset(label.strip() for label in match.group(1).split(",") if label.strip())
        out.append((labels, selectors(_group(expr, match.end() - 1))))
    return out


def is_counter_series(name: str) -> bool:
    return name.endswith(_COUNTER_SUFFIXES)


def counters_outside_rate(expr: str) -> list[str]:
    """Counter series read as raw totals (not the direct argument of rate/increase)."""
    bad = []
    for match in _NAME.finditer(expr):
        name = match.group(1)
        if is_counter_series(name) and not re.search(r"\b(rate|increase)\($", expr[: match.start()]):
            bad.append(name)
    return bad
