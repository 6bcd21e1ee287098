"""The server-wide budget of memory for incoming values (``--incoming-bytes``).

A Put names a value's length before its bytes arrive, and the server allocates
the buffer that receives it (the RAM tier then keeps that buffer), so every
value being received holds its whole length from its first frame to its last.
Without a bound, a few callers that declare large values and send almost
nothing would hold any amount of memory. Every edge therefore takes a
``Reservation`` for a value (and the data port for a request's table) before
allocating, and gives it back once the value is stored or dropped. A
reservation that does not fit is refused at once with ``Overloaded``
(answered ``UNAVAILABLE``: the same Put may succeed a moment later), never
waited for; stalled callers are cut by their edge's stall deadline
(``--data-timeout``), which frees what they held.
"""

from __future__ import annotations

from kvtier.cacheserver.errors import Overloaded


class ReceiveBudget:
    """Counts the bytes reserved for values being received, up to ``limit_bytes``."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used = 0
        self.refused = 0

    def reserve(self, field: str, size: int) -> Reservation:
        """Reserves ``size`` bytes; raises Overloaded (naming ``field``) when they do not fit."""
        if self.used + size > self.limit_bytes:
            self.refused += 1
            raise Overloaded(
                f"{field}: {size} bytes cannot be received now: {self.used} of the server's "
                f"{self.limit_bytes} bytes for incoming values (--incoming-bytes) are in use; "
                "retry shortly"
            )
        self.used += size
        return Reservation(self, size)


class Reservation:
    """Bytes held in a ``ReceiveBudget``; ``release()`` (idempotent) gives them back."""

    def __init__(self, budget: ReceiveBudget, size: int) -> None:
        self._budget: ReceiveBudget | None = budget
        self.size = size

    def release(self) -> None:
        if self._budget is not None:
            self._budget.used -= self.size
            self._budget = None

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()
