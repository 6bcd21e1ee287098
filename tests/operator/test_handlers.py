from __future__ import annotations

from typing import Any

import pytest

from kvtier.operator.handlers import new_problem
from kvtier.operator.main import build_parser, run


def status(reason: str, message: str = "m", ok: str = "False") -> dict[str, Any]:
    return {"conditions": [{"type": "Ready", "status": ok, "reason": reason, "message": message}]}


def test_a_problem_the_user_must_fix_is_reported_when_it_first_appears() -> None:
    assert new_problem({}, status("InvalidSpec", "spec.x: bad")) == ("InvalidSpec", "spec.x: bad")
    assert new_problem(status("ReplicasNotReady"), status("TierNotFound")) == ("TierNotFound", "m")


def test_the_same_problem_is_not_reported_again() -> None:
    assert new_problem(status("InvalidSpec"), status("InvalidSpec")) is None


def test_a_changed_message_is_a_new_problem() -> None:
    assert new_problem(status("InvalidSpec", "a"), status("InvalidSpec", "b")) == (
        "InvalidSpec",
        "b",
    )


def test_waiting_for_replicas_is_not_a_problem_to_report() -> None:
    assert new_problem({}, status("ReplicasNotReady")) is None
    assert new_problem({}, status("Ready", ok="True")) is None


def test_the_operator_watches_all_namespaces_unless_given_some() -> None:
    assert build_parser().parse_args([]).namespace == []
    assert build_parser().parse_args(["-n", "a", "-n", "team-*"]).namespace == ["a", "team-*"]


def test_namespaces_and_all_namespaces_exclude_each_other() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-n", "a", "--all-namespaces"])


def test_a_resync_period_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        run(["--resync-seconds", "0"])
