"""The RAM tier: an LRU of values bounded in bytes (and per tenant, with quotas).

Values stay in process memory as they arrived (immutable bytes, or read-only
memoryviews over the received message or reassembly buffer), so a get hands
out the stored object itself (no copy) and no verification is needed (nothing
at rest can corrupt it). Single-threaded: it is only touched from the server's
event loop.

The buffers of values it drops go to ``pool`` (``kvtier.proto.buffers``), whose bytes
count against the capacity: entries + pool <= ``capacity_bytes``. When the
tier is full, an entry of a recyclable size evicts enough to keep the pool
(and one more buffer of its size, for the next Put) within the capacity.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvtier.cacheserver.arena import SharedArena
from kvtier.cacheserver.lru import ByteLru
from kvtier.cacheserver.namespace import tenant_of
from kvtier.cacheserver.tiers import TierCounters, TierUsage
from kvtier.proto.buffers import BufferPool


class RamTier:
    name = "ram"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        tenant_quota_bytes: int = 0,
        recycle_bytes: int = 0,
        arena: SharedArena | None = None,
    ) -> None:
        self.counters = TierCounters()
        self.lru = ByteLru(capacity_bytes, tenant_quota_bytes)
        self.arena = arena
        self.pool = BufferPool(0 if arena is not None else recycle_bytes)
        self._values: dict[bytes, bytes | memoryview] = {}

    @property
    def capacity_bytes(self) -> int:
        return self.lru.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: int) -> None:
        self.lru.capacity_bytes = value
        self.pool.shrink(value - self.lru.used)

    async def get(self, key: bytes) -> bytes | memoryview | None:
        value = self._values.get(key)
        if value is None:
            self.counters.miss(key)
            return None
        self.lru.touch(key)
        self.counters.hit(key)
        return value

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._values for k in keys]

    async def put(self, key: bytes, value: bytes | memoryview) -> bool:
        data = value if isinstance(value, bytes) else value.toreadonly()
        size = memoryview(data).nbytes
        if not self.lru.fits(size):
            if self.lru.remove(key) is not None:  # an older value of the key must not be served
                self._forget(key)
            return False
        if self.arena is not None and self.arena.locate(data) is None:
            shared = self.arena.take(size, tenant_of(key))
            if shared is not None:  # served from shared memory to same-node clients
                shared[:] = memoryview(data).cast("B")
                data = shared.toreadonly()
        if self.lru.remove(key) is not None:
            self._forget(key)
        if self.lru.used + size + self.pool.bytes > self.lru.capacity_bytes:
            self.pool.keep_only(size)  # a full tier keeps no buffers of sizes nobody puts now
        recyclable = (  # a whole received buffer: its own buffer may come back to the pool
            isinstance(data, memoryview)
            and isinstance(data.obj, bytearray)
            and data.nbytes == len(data.obj)
        )
        reserve = self.pool.bytes + (size if recyclable and self.pool.wants(size) else 0)
        victims = self.lru.admit(key, size, reserve)
        for victim in victims:
            self._forget(victim)
        self.counters.evicted(victims)
        self.pool.shrink(self.lru.capacity_bytes - self.lru.used)
        self._values[key] = data
        return True

    async def delete(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if self.lru.remove(key) is not None:
                self._forget(key)
                n += 1
        return n

    def _forget(self, key: bytes) -> None:
        """Drops a value the LRU no longer holds; its buffer goes to the pool if nothing else sees it."""
        value = self._values.pop(key)
        if not isinstance(value, memoryview):
            return
        buf = value.obj
        whole = isinstance(buf, bytearray) and value.nbytes == len(buf)
        del value
        # Every memoryview of ``buf`` shares one export that holds a reference
        # to it; with no view alive anywhere, the only references left are
        # ``buf`` here and getrefcount's argument (CPython counts exactly).
        if whole and sys.getrefcount(buf) == 2:
            room = self.lru.capacity_bytes - self.lru.used - self.pool.bytes
            self.pool.keep(buf, room)  # type: ignore[arg-type]

    def usage(self) -> TierUsage:
        return TierUsage(self.lru.used, self.lru.capacity_bytes, len(self.lru))

    def tenant_usage(self, tenant: str) -> TierUsage:
        return self.lru.tenant_usage(tenant)

    def tenant_usages(self) -> dict[str, TierUsage]:
        return self.lru.tenant_usages()

    def receive_buffer(self, size: int, tenant: str) -> bytearray | memoryview:
        """A buffer to receive a value of ``size`` bytes of ``tenant``'s into: that tenant's
        shared memory with an arena, else recycled when the pool has one."""
        if self.arena is not None:
            shared = self.arena.take(size, tenant)
            if shared is not None:
                return shared
        return self.pool.take(size)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._values.clear()
        self.pool.clear()
        if self.arena is not None:
            self.arena.close()
        self.lru = ByteLru(self.lru.capacity_bytes, self.lru.tenant_quota_bytes)
