"""The RAM tier: an LRU of values bounded in bytes.

Values stay in process memory as they arrived (immutable bytes, or read-only
memoryviews over the received message or reassembly buffer), so a get hands
out the stored object itself (no copy) and no verification is needed (nothing
at rest can corrupt it). Single-threaded: it is only touched
from the server's event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvtier.cacheserver.tiers import TierCounters, TierUsage


class RamTier:
    name = "ram"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.counters = TierCounters()
        self._entries: OrderedDict[bytes, bytes | memoryview] = OrderedDict()
        self._used = 0

    async def get(self, key: bytes) -> bytes | memoryview | None:
        value = self._entries.get(key)
        if value is None:
            self.counters.misses += 1
            return None
        self._entries.move_to_end(key)
        self.counters.hits += 1
        return value

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._entries for k in keys]

    async def put(self, key: bytes, value: bytes | memoryview) -> bool:
        data = value if isinstance(value, bytes) else value.toreadonly()
        size = memoryview(data).nbytes
        if size > self.capacity_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self._used -= memoryview(old).nbytes
        while self._used + size > self.capacity_bytes and self._entries:
            _, evicted = self._entries.popitem(last=False)
            self._used -= memoryview(evicted).nbytes
            self.counters.evictions += 1
        self._entries[key] = data
        self._used += size
        return True

    async def delete(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= memoryview(old).nbytes
                n += 1
        return n

    def usage(self) -> TierUsage:
        return TierUsage(self._used, self.capacity_bytes, len(self._entries))

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._entries.clear()
        self._used = 0
