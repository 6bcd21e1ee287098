"""The RAM tier: an LRU of values bounded in bytes (and per tenant, with quotas).

Values stay in process memory as they arrived (immutable bytes, or read-only
memoryviews over the received message or reassembly buffer), so a get hands
out the stored object itself (no copy) and no verification is needed (nothing
at rest can corrupt it). Single-threaded: it is only touched from the server's
event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.cacheserver.lru import ByteLru
from kvtier.cacheserver.tiers import TierCounters, TierUsage


class RamTier:
    name = "ram"

    def __init__(self, capacity_bytes: int, *, tenant_quota_bytes: int = 0) -> None:
        self.counters = TierCounters()
        self.lru = ByteLru(capacity_bytes, tenant_quota_bytes)
        self._values: dict[bytes, bytes | memoryview] = {}

    @property
    def capacity_bytes(self) -> int:
        return self.lru.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: int) -> None:
        self.lru.capacity_bytes = value

    async def get(self, key: bytes) -> bytes | memoryview | None:
        value = self._values.get(key)
        if value is None:
            self.counters.misses += 1
            return None
        self.lru.touch(key)
        self.counters.hits += 1
        return value

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._values for k in keys]

    async def put(self, key: bytes, value: bytes | memoryview) -> bool:
        data = value if isinstance(value, bytes) else value.toreadonly()
        size = memoryview(data).nbytes
        if not self.lru.fits(size):
            return False
        for victim in self.lru.admit(key, size):
            del self._values[victim]
            self.counters.evictions += 1
        self._values[key] = data
        return True

    async def delete(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if self.lru.remove(key) is not None:
                del self._values[key]
                n += 1
        return n

    def usage(self) -> TierUsage:
        return TierUsage(self.lru.used, self.lru.capacity_bytes, len(self.lru))

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._values.clear()
        self.lru = ByteLru(self.lru.capacity_bytes, self.lru.tenant_quota_bytes)
