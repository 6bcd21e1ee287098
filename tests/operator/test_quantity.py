from __future__ import annotations

import pytest

from kvtier.operator.quantity import format_mebibytes, parse_bytes


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [("2Gi", 2 * 2**30), ("512Mi", 512 * 2**20), ("20G", 20 * 10**9), ("1.5Gi", 3 * 2**29),
     ("1024", 1024), (4096, 4096)],
)  # fmt: skip
def test_quantities_parse_to_bytes(quantity: int | str, expected: int) -> None:
    assert parse_bytes(quantity) == expected


@pytest.mark.parametrize("quantity", ["2GB", "-1Gi", "Gi", "", 0, "0"])
def test_malformed_or_empty_quantities_are_rejected_with_the_accepted_forms(
    quantity: int | str,
) -> None:
    with pytest.raises(ValueError, match=r"2Gi|positive|at least one byte"):
        parse_bytes(quantity)


def test_mebibytes_round_up() -> None:
    assert format_mebibytes(2**30 + 1) == "1025Mi"
