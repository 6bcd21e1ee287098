"""Byte-bounded LRU bookkeeping with per-tenant quotas, shared by the RAM and disk tiers.

``admit(key, size)`` makes room for a new entry and returns the keys to evict:

1. the tenant's own least recently used entries, while the tenant would go
   over its quota (``tenant_quota_bytes``, 0 = no quota);
2. then the least recently used entries of anybody, while the tier would go
   over its capacity;
3. then, while the entry plus ``reserve`` bytes (the RAM tier's recycled
   buffers, ``kvtier.proto.buffers``) would go over the capacity, the least recently
   used entries of anybody, or of the same tenant only when quotas are on.

With quotas whose sum is at most the capacity, step 2 never runs for a
tenant within its quota, so one tenant's load cannot evict another tenant's
entries. Tenants are read from the namespaced key (``namespace.tenant_of``).
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.cacheserver.namespace import tenant_of
from kvtier.cacheserver.tiers import TierUsage


class ByteLru:
    def __init__(self, capacity_bytes: int, tenant_quota_bytes: int = 0) -> None:
        self.capacity_bytes = capacity_bytes
        self.tenant_quota_bytes = tenant_quota_bytes
        self.used = 0
        self._order: OrderedDict[bytes, int] = OrderedDict()  # key -> size, LRU first
        self._tenants: dict[str, OrderedDict[bytes, None]] = {}
        self._tenant_used: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def fits(self, size: int) -> bool:
        """Whether an entry of this size can ever be stored."""
        limit = self.capacity_bytes
        if self.tenant_quota_bytes:
            limit = min(limit, self.tenant_quota_bytes)
        return size <= limit

    def size_of(self, key: bytes) -> int | None:
        """The size ``key`` was admitted with, or None if it is not held."""
        return self._order.get(key)

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)
            self._tenants[tenant_of(key)].move_to_end(key)

    def admit(self, key: bytes, size: int, reserve: int = 0) -> list[bytes]:
        """Records ``key`` (replacing an older entry) and returns the keys evicted for it.

        ``reserve``: bytes the caller keeps outside the entries but within the
        capacity; made room for as far as step 3 allows.
        """
        self.remove(key)
        tenant = tenant_of(key)
        evicted: list[bytes] = []
        if self.tenant_quota_bytes:
            own = self._tenants.get(tenant)
            while own and self._tenant_used.get(tenant, 0) + size > self.tenant_quota_bytes:
                victim = next(iter(own))
                self.remove(victim)
                evicted.append(victim)
        while self._order and self.used + size > self.capacity_bytes:
            victim = next(iter(self._order))
            self.remove(victim)
            evicted.append(victim)
        if reserve:
            pool = self._tenants.get(tenant) if self.tenant_quota_bytes else self._order
            while pool and self.used + size + reserve > self.capacity_bytes:
                victim = next(iter(pool))
                self.remove(victim)
                evicted.append(victim)
        self._order[key] = size
        self._tenants.setdefault(tenant, OrderedDict())[key] = None
        self._tenant_used[tenant] = self._tenant_used.get(tenant, 0) + size
        self.used += size
        return evicted

    def remove(self, key: bytes) -> int | None:
        """Forgets ``key``; returns its size, or None if it was not there."""
        size = self._order.pop(key, None)
        if size is None:
            return None
        tenant = tenant_of(key)
        own = self._tenants[tenant]
        del own[key]
        self._tenant_used[tenant] -= size
        if not own:
            del self._tenants[tenant]
            del self._tenant_used[tenant]
        self.used -= size
        return size

    def tenant_used(self, tenant: str) -> int:
        return self._tenant_used.get(tenant, 0)

    def tenant_entries(self, tenant: str) -> int:
        return len(self._tenants.get(tenant, ()))

    def tenant_capacity(self) -> int:
        """The bytes one tenant may fill: its quota, or the whole capacity."""
        if self.tenant_quota_bytes:
            return min(self.tenant_quota_bytes, self.capacity_bytes)
        return self.capacity_bytes

    def tenant_usage(self, tenant: str) -> TierUsage:
        return TierUsage(self.tenant_used(tenant), self.tenant_capacity(), self.tenant_entries(tenant))

    def tenant_usages(self) -> dict[str, TierUsage]:
        return {tenant: self.tenant_usage(tenant) for tenant in self._tenants}
