"""The figures of the fault tests on real vLLM, for docs/security.md's fault table.

A fault test ``record``s one row: the fault, the transport the engines used when it
struck, how many requests were answered, how many outputs differ from the no-cache
run, the longest call while the fault lasted against the bound the deadlines give it, and
the test that struck it.
tests/e2e/conftest.py prints the rows at the end of the run (``pytest_terminal_summary``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class FaultRow:
    fault: str
    transport: str
    answered: int
    requests: int
    wrong: int
    worst_stall_s: float
    bound_s: float | None
    test: str

    def line(self) -> str:
        bound = "no deadline applies" if self.bound_s is None else f"bound {self.bound_s:.0f} s"
        return (
            f"| {self.fault} | {self.transport} | {self.answered}/{self.requests} | "
            f"{self.wrong} | {self.worst_stall_s:.1f} s ({bound}) | `{self.test}` |"
        )


ROWS: list[FaultRow] = []


def record(
    fault: str,
    transport: str,
    outputs: list[list[int]],
    expected: list[list[int]],
    worst_stall_s: float,
    bound_s: float | None,
) -> None:
    """Adds a row; ``outputs`` are the token ids the engines answered, ``expected`` the
    no-cache run's (same order)."""
    wrong = sum(o != e for o, e in zip(outputs, expected, strict=False))
    wrong += abs(len(expected) - len(outputs))
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
    ROWS.append(
        FaultRow(fault, transport, len(outputs), len(expected), wrong, worst_stall_s, bound_s, test)
    )
