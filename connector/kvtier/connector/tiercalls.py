"""The tier calls each connector half makes, as Protocols that ``TierClient`` satisfies.

The halves take any object with these methods (tests pass small stand-ins, e.g. a tier
that fails on purpose). This module imports neither vLLM nor torch::

    LookupTier   the KV scheduler: one Lookup per request
    PutTier      the background sender: Put, and Delete of entries that failed verification
    GetTier      the KV worker and the encoder-cache scheduler: Get (+ Put and Delete), and
                 giving values back (recycle) and choosing their buffers (receive_into)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableSequence, Sequence
from typing import Any, Protocol

from typing_extensions import Buffer


class LookupTier(Protocol):
    def lookup(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int: ...


class PutTier(Protocol):
    def put(
        self,
        items: Iterable[tuple[bytes, Buffer | Sequence[Buffer]]],
        *,
        timeout_s: float | None = None,
    ) -> int: ...

    def delete(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int: ...


class GetTier(PutTier, Protocol):
    def get(
        self,
        keys: Sequence[bytes],
        *,
        stop_at_first_miss: bool = True,
        timeout_s: float | None = None,
    ) -> Sequence[bytes | memoryview | None]: ...

    def recycle(self, values: MutableSequence[bytes | memoryview | None]) -> int: ...

    def receive_into(self, allocate: Callable[[int], Any]) -> None: ...
