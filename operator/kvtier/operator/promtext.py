"""The Prometheus text exposition format (what ``/metrics`` serves), read into samples.

Only what the operator needs: every sample line ``name{label="value",...} value
[timestamp]``, comments and blank lines skipped. Label values may hold escaped
quotes, backslashes and newlines, commas and braces. A line that is not a sample
raises ``MetricsFormatError`` naming the line number (the whole page is refused:
half a page would be summed into a wrong number).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvtier.operator.errors import OperatorError

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class MetricsFormatError(OperatorError):
    """A ``/metrics`` page is not in the Prometheus text format."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    """Every sample of a page, in order."""
    samples = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise MetricsFormatError(f"line {number}: not a sample: {line[:80]!r}")
        name, label_text, value_text = match.groups()
        try:
            value = float(value_text)  # also +Inf, -Inf and NaN
        except ValueError:
            raise MetricsFormatError(f"line {number}: {value_text[:40]!r} is not a number") from None
        samples.append(Sample(name, _labels(label_text or "", number), value))
    return samples


def total(samples: Iterable[Sample], name: str) -> float | None:
    """The sum of every series of ``name`` (over all label values), None if there is none.
    NaN samples (a series without data) count as nothing."""
    values = [s.value for s in samples if s.name == name and not math.isnan(s.value)]
    return sum(values) if values else None


def _labels(text: str, number: int) -> dict[str, str]:
    labels: dict[str, str] = {}
    position = 0
    while position < len(text.rstrip()):
        match = _LABEL.match(text, position)
        if match is None:
            raise MetricsFormatError(f"line {number}: bad labels {text[:80]!r}")
        labels[match.group(1)] = re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m.group(0)], match.group(2))
        position = match.end()
    return labels
