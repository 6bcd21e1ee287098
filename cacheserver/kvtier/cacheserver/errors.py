"""Errors of the cache tier server.

The tree::

    ServerError                    base of everything raised by kvtier.cacheserver
    ├── SettingsError              a bad flag / env var at start-up (names the flag and what it accepts)
    ├── RequestError               a call the server refuses (the message names the field)
    │   ├── InvalidRequest         empty/oversized key, bad frame or table, unknown field
    │   ├── LimitExceeded          too many keys, value too large
    │   ├── Unauthenticated        missing or unknown credentials
    │   ├── Overloaded             the server cannot take this now (memory for incoming values
    │   │                          is spent, --incoming-bytes): retry later
    │   └── Stalled                the caller stopped sending inside a request (--data-timeout)
    ├── TierFailure                a storage tier could not do an operation (I/O, Redis down);
    │                              the store degrades to the other tiers, the caller never sees it
    └── ChecksumMismatch           a value stored from memory its sender can still change did
                                   not match the sender's checksum (nothing of it was stored)

The errors say what went wrong, not how a transport reports it: each edge maps
them to its own status at the edge only (``kvtier.cacheserver.servicer`` to gRPC
status codes, ``kvtier.cacheserver.dataport`` to the data port's status numbers,
which are the same codes).
"""

from __future__ import annotations


class ServerError(Exception):
    """Base of every error raised by ``kvtier.cacheserver``."""


class SettingsError(ServerError, ValueError):
    """A setting is invalid; the message names the flag, its env var and what it accepts."""


class RequestError(ServerError):
    """A request the server refuses; the message names the field and what is accepted."""


class InvalidRequest(RequestError):
    """The request is malformed (answered INVALID_ARGUMENT)."""


class LimitExceeded(RequestError):
    """The request exceeds a configured limit (answered RESOURCE_EXHAUSTED)."""


class Unauthenticated(RequestError):
    """Missing or unknown credentials (answered UNAUTHENTICATED)."""


class Overloaded(RequestError):
    """The server cannot take the request now; the same request may succeed later (UNAVAILABLE)."""


class Stalled(RequestError):
    """The caller sent nothing for too long inside a request (DEADLINE_EXCEEDED)."""


class TierFailure(ServerError):
    """A storage tier failed an operation; ``tier`` names it ("disk", "redis")."""

    def __init__(self, tier: str, message: str) -> None:
        super().__init__(f"{tier} tier: {message}")
        self.tier = tier


class ChecksumMismatch(ServerError):
    """The bytes a tier stored from memory its sender can still change (a same-node client's
    staging segment) do not match the checksum the sender gave: nothing of the value was
    stored (an older value of its key stays). The edge answers the request INVALID_ARGUMENT."""
