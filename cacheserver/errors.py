"""Errors of the cache tier server.

The tree::

    ServerError                    base of everything raised by kvtier.cacheserver
    ├── SettingsError              a bad flag / env var at start-up (names the flag and what it accepts)
    ├── RequestError               a call the server refuses; carries its gRPC status code
    │   ├── InvalidRequest         INVALID_ARGUMENT: empty/oversized key, bad frame, unknown field
    │   ├── LimitExceeded          RESOURCE_EXHAUSTED: too many keys, value too large
    │   └── Unauthenticated        UNAUTHENTICATED: missing or unknown credentials
    └── TierFailure                a storage tier could not do an operation (I/O, Redis down);
                                   the store degrades to the other tiers, the caller never sees it

``kvtier.cacheserver.servicer`` is the one place that turns a ``RequestError``
into a gRPC status.
"""

from __future__ import annotations

import grpc


class ServerError(Exception):
    """Base of every error raised by ``kvtier.cacheserver``."""


class SettingsError(ServerError, ValueError):
    """A setting is invalid; the message names the flag, its env var and what it accepts."""


class RequestError(ServerError):
    """A request the server refuses; ``code`` is the gRPC status it is answered with."""

    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT


class InvalidRequest(RequestError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class LimitExceeded(RequestError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(RequestError):
    code = grpc.StatusCode.UNAUTHENTICATED


class TierFailure(ServerError):
    """A storage tier failed an operation; ``tier`` names it ("disk", "redis")."""

    def __init__(self, tier: str, message: str) -> None:
        super().__init__(f"{tier} tier: {message}")
        self.tier = tier
