"""Types of the C helper connector/kvtier/connector/chunks/_finite.c (see its opening comment)."""

from typing_extensions import Buffer

def first_nonfinite(payload: Buffer, width: int, mask: int, /) -> int: ...
