"""The alert rules, checked and unit-tested with promtool."""

from __future__ import annotations

import subprocess
from pathlib import Path

from kvtier.testing.queries import RULE_FILES, rules

RULES_TEST = Path(__file__).with_name("rules_test.yaml")


def test_alert_rule_files_pass_promtool_check_rules(promtool: str) -> None:
    result = subprocess.run(
        [promtool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_fire_and_stay_quiet_on_the_series_of_rules_test_yaml(promtool: str) -> None:
    result = subprocess.run(
        [promtool, "test", "rules", RULES_TEST.name], cwd=RULES_TEST.parent, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_the_issue_asks_for_exists_and_is_unit_tested() -> None:
    alerts = {rule["alert"] for rule in rules()}
    assert {
        "KvtierServerDown",
        "KvtierHitRateCollapsed",
        "KvtierVerificationFailures",
        "KvtierConnectorCircuitOpen",
    } <= alerts
    tested = RULES_TEST.read_text()
    assert [a for a in sorted(alerts) if f"alertname: {a}\n" not in tested] == []


def test_every_alert_has_a_severity_summary_and_description() -> None:
    for rule in rules():
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
