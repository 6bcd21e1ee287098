from __future__ import annotations

from typing import Any

import pytest

from kvtier.operator.handlers import new_problem, status_update
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


def test_a_traffic_period_is_zero_for_off_or_positive() -> None:
    with pytest.raises(SystemExit):
        run(["--traffic-seconds", "-1"])
    assert build_parser().parse_args(["--traffic-seconds", "0"]).traffic_seconds == 0


def body(generation: int, **status: Any) -> dict[str, Any]:
    return {"metadata": {"generation": generation}, "status": status}


def test_a_changed_status_is_written() -> None:
    new = {"observedGeneration": 2, "tier": "shared"}
    assert status_update(body(2), body(2, observedGeneration=1), new) == new


def test_an_unchanged_status_is_not_written_again() -> None:
    same = {"observedGeneration": 2, "tier": "shared"}
    assert status_update(body(2), body(2, **same), same) is None


def test_a_reconcile_of_a_generation_edited_meanwhile_writes_no_status() -> None:
    # A resync timer reconciled generation 1 while an edit made generation 2: its status
    # would describe the old spec (and hide generation 2 from later resyncs).
    stale = {"observedGeneration": 1, "tier": "qwen-tier"}
    assert status_update(body(2), body(1, observedGeneration=1), stale) is None


def test_operator_identity_needs_no_passwd_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator image runs as a numeric user with no passwd entry (uid 65532, or any uid
    a cluster picks): kopf's own guess (getpass.getuser) raises there, so the operator
    names itself from the pod or the host."""
    import getpass
    import pwd
    import socket

    from kvtier.operator.main import identity

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    for name in ("LOGNAME", "USER", "LNAME", "USERNAME", "POD_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(KeyError):
        getpass.getuser()  # what kopf would call
    assert identity() == f"kvtier-operator@{socket.gethostname()}"
    monkeypatch.setenv("POD_ID", "kvtier-operator-5d9c-xyz")
    assert identity() == "kvtier-operator-5d9c-xyz"
