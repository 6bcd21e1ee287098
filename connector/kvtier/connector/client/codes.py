"""The one table of status codes the client treats as "the tier is unavailable".

Both transports name a failed call's status with gRPC's code names: gRPC calls carry
them, and the data port answers with gRPC's code numbers (``kvtier.proto.datawire``).
A code in ``UNAVAILABLE_CODES`` means the tier could not serve the call now (down,
too slow, overloaded, failed inside): ``TierUnavailable``, which the connector
recomputes and its circuit breaker counts, and which makes the client pick its
transport again. Any other code is the tier refusing the call: ``TierRejected``
with the code's name (a bug, a limit, a bad token), which no retry would change.
"""

from __future__ import annotations

from typing import Final

import grpc

from kvtier.connector.errors import TierError, TierRejected, TierUnavailable

UNAVAILABLE_CODES: Final = frozenset(
    {
        "UNAVAILABLE",
        "DEADLINE_EXCEEDED",
        "CANCELLED",
        "UNKNOWN",
        "INTERNAL",
        "ABORTED",
    }
)

_NAMES: Final = {code.value[0]: code.name for code in grpc.StatusCode}


def code_name(number: int) -> str:
    """gRPC's name of a status code number (``"status N"`` for one gRPC does not define)."""
    return _NAMES.get(number, f"status {number}")


def tier_error(op: str, code: str, detail: str) -> TierError:
    """The error of a call ``op`` that ended with status ``code`` (a gRPC code name)."""
    message = f"{op}: {code}: {detail}"
    if code in UNAVAILABLE_CODES:
        return TierUnavailable(message)
    return TierRejected(message, code)
