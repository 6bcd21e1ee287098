"""The storage-tier extension point.

A tier stores values under namespaced keys (``namespace.scoped``). Three exist:
``ram`` (``kvtier.cacheserver.ram``), ``disk`` (``kvtier.cacheserver.disk``) and
``redis`` (``kvtier.cacheserver.redis_tier``). The store
(``kvtier.cacheserver.store``) chains them: reads go down the chain and promote
on a hit, writes land in the first tier and are written behind to the others.

Contract every tier keeps:

- ``get`` returns the value or ``None`` for a miss. A stored record that fails
  verification is deleted, counted in ``verification_failures`` and returned as
  a miss: a tier never hands out a value it cannot vouch for.
- Writes are atomic: a concurrent or later ``get`` sees the whole new value or
  none of it, never a part.
- Backend failures (I/O errors, Redis down) raise ``TierFailure``; the store
  then degrades to the other tiers. A miss is not a failure.
- ``put`` may evict older entries to stay within capacity; a value larger than
  the whole capacity is not stored (``put`` returns False).
- Counters and usage are kept per tenant too (``TierCounters.hit(key)`` and
  so on read the tenant from the namespaced key; ``tenant_usage``): ``Stats``
  answers for the caller's tenant only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvtier.cacheserver.namespace import tenant_of
from kvtier.cacheserver.record import RecordFile


@dataclass
class TenantCounters:
    """One tenant's share of a tier's counters."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0


@dataclass
class TierCounters:
    """Running totals a tier keeps about itself (exported as metrics), and per tenant."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    verification_failures: int = 0
    tenants: dict[str, TenantCounters] = field(default_factory=dict)

    def of(self, tenant: str) -> TenantCounters:
        """A tenant's counters (zero for a tenant the tier has not seen)."""
        return self.tenants.get(tenant) or TenantCounters()

    def _tenant(self, key: bytes) -> TenantCounters:
        return self.tenants.setdefault(tenant_of(key), TenantCounters())

    def hit(self, key: bytes) -> None:
        self.hits += 1
        self._tenant(key).hits += 1

    def miss(self, key: bytes) -> None:
        self.misses += 1
        self._tenant(key).misses += 1

    def evicted(self, keys: Sequence[bytes]) -> None:
        self.evictions += len(keys)
        for key in keys:
            self._tenant(key).evictions += 1


@dataclass(frozen=True)
class TierUsage:
    used_bytes: int
    capacity_bytes: int  # 0 when the tier does not know (Redis with no maxmemory)
    entries: int


class Tier(Protocol):
    """A storage tier. Implementations: RamTier, DiskTier, RedisTier."""

    name: str
    counters: TierCounters

    async def get(self, key: bytes) -> bytes | memoryview | None:
        """The value stored under ``key``, or None (miss or corrupt record)."""
        ...

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether a value is stored (cheap: no payload is read or verified)."""
        ...

    async def put(self, key: bytes, value: bytes | memoryview) -> bool:
        """Stores ``value`` atomically; False if it can never fit."""
        ...

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Removes keys; returns how many were present."""
        ...

    def usage(self) -> TierUsage: ...

    def tenant_usage(self, tenant: str) -> TierUsage:
        """One tenant's bytes and entries, and the capacity it may fill (its quota, if any)."""
        ...

    def tenant_usages(self) -> dict[str, TierUsage]:
        """``tenant_usage`` of every tenant the tier holds entries of (or knows a figure for)."""
        ...

    async def ping(self) -> None:
        """Raises TierFailure when the backend is unreachable (used to probe recovery)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class FileTier(Protocol):
    """A tier whose values a same-node client may read from their files itself (DiskTier)."""

    async def open_record(self, key: bytes) -> RecordFile | None:
        """``get``, but the value's record file opened and its header checked, not read:
        the caller reads it (and closes it)."""
        ...


@runtime_checkable
class CheckedWriteTier(Protocol):
    """A tier that stores a value straight from memory its sender can still change (DiskTier)."""

    async def put_checked(self, key: bytes, source: memoryview, checksum: int) -> bool:
        """``put`` of ``source``'s bytes, copied once and checked as stored: what is stored is
        exactly what was checked. ``ChecksumMismatch`` when that is not ``checksum`` (nothing
        stored; an older value of ``key`` stays)."""
        ...
