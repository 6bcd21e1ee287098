"""Kubernetes quantities (``2Gi``, ``500M``, ``1.5Gi``, ``1024``) as byte counts."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES = {
    "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def parse_bytes(value: int | str) -> int:
    """Return the byte count of a quantity; ValueError names the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"expected a quantity such as 2Gi or a byte count, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"expected a positive byte count, got {value}")
        return value
    match = _QUANTITY.match(value.strip())
    if match is None:
        raise ValueError(
            f"expected a quantity such as 2Gi, 512Mi or 20G, or a byte count, got {value!r}"
        )
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as exc:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(f"not a number: {value!r}") from exc
    result = int(number * _SUFFIXES[match.group(2) or ""])
    if result < 1:
        raise ValueError(f"expected at least one byte, got {value!r}")
    return result


def format_mebibytes(n_bytes: int) -> str:
    """Format a byte count as a whole number of mebibytes, rounded up (``2560Mi``)."""
    return f"{-(-n_bytes // 2**20)}Mi"
