"""Errors raised by the kvtier connector library.

The tree::

    ConnectorError                 base of everything raised here
    ├── ConfigError                a bad kv_connector_extra_config / key setting (names the field)
    ├── ChunkDecodeError           a stored chunk failed verification (truncated, bad checksum,
    │                              wrong key fingerprint, unknown version or codec): treat as a miss
    ├── NonFiniteChunk             a chunk to store holds a NaN or an infinity: not stored
    └── TierError                  the cache tier could not serve a call
        ├── TierUnavailable        transport failure, deadline exceeded, or circuit open: recompute
        └── TierRejected           the tier refused the call as invalid (a bug or a limit): recompute

Callers inside vLLM turn every ``TierError`` and ``ChunkDecodeError`` into a
recompute; none of them may reach the engine.
"""


class ConnectorError(Exception):
    """Base of every error raised by ``kvtier.connector``."""


class ConfigError(ConnectorError, ValueError):
    """A configuration value is invalid; the message names the field and what it accepts."""


CHUNK_ERROR_REASONS = (
    "truncated",
    "format",
    "codec",
    "fingerprint",
    "length",
    "checksum",
    "layout",
    "shape",
    "nonfinite",
)
"""``ChunkDecodeError.reason`` values (a metric label, so a fixed set): ``truncated`` (shorter
than a header), ``format`` (not a kvtier chunk, or an unknown format version), ``codec``
(unknown codec id, or a payload the codec cannot decode), ``fingerprint`` (stored under
another key), ``length`` (header and blob lengths disagree), ``checksum``, ``layout`` (bad
dtype/shape fields, or a payload that does not fit them), ``shape`` (a valid chunk this
engine cannot use: another dtype or KV shape), ``nonfinite`` (a KV chunk holding a NaN or an
infinity, from a writer that did not refuse it: ``chunks/finite.py``)."""


class ChunkDecodeError(ConnectorError):
    """A stored chunk failed verification; the caller treats it as a miss.

    ``reason`` is one of ``CHUNK_ERROR_REASONS``.
    """

    def __init__(self, message: str, reason: str = "format") -> None:
        assert reason in CHUNK_ERROR_REASONS, reason
        super().__init__(message)
        self.reason = reason


class NonFiniteChunk(ConnectorError, ValueError):
    """A chunk about to be stored holds a NaN or an infinity (``chunks/finite.py``): the
    caller drops the save, so no other engine ever loads it."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index
        """The first such element of the payload."""


class TierError(ConnectorError):
    """The cache tier could not serve a call."""


class TierUnavailable(TierError):
    """The tier is unreachable, too slow (deadline), or the circuit breaker is open."""


class TierRejected(TierError):
    """The tier answered the call with an error status other than unavailability.

    ``code``: the status name (``UNAUTHENTICATED``, ``INVALID_ARGUMENT``, ...) when known.
    """

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code
