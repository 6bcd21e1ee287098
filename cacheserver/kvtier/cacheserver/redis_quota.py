"""Per-tenant byte quotas in the Redis tier: a ledger kept in Redis itself.

The RAM and disk tiers know every entry they hold (``ByteLru``). Redis is
shared by every replica of a tier (and survives their restarts), so its
per-tenant bookkeeping lives in Redis too, next to the values, under keys of
their own (``LEDGER_PREFIX``, apart from the values' ``kvtier:v1:``)::

    kvtier:v1q:{<tenant>}:lru     sorted set: the tenant's keys by last use (ms)
    kvtier:v1q:{<tenant>}:size    hash: key -> record bytes
    kvtier:v1q:{<tenant>}:bytes   the tenant's record bytes in total
    kvtier:v1q:tenants            set: the tenants that have a ledger

The ``{<tenant>}`` hash tag puts one tenant's three keys in one Cluster slot,
so a Lua script updates them atomically: a Put charges its record to the
tenant (replacing the key's old charge) and, while the tenant is over its
quota, takes its own least recently used keys off the ledger and returns them
for the tier to delete. A tenant at its quota therefore evicts its own
entries, never another's. A Get hit marks its key used; a Delete takes keys
off.

What the ledger cannot see: values Redis drops by itself (TTL expiry, its own
``maxmemory`` eviction) stay charged until the tenant's own eviction reaches
them (their charge is then freed; the DEL finds nothing), so a tenant's
figure may run ahead of what Redis holds, never behind it. The charge is the
record's size, not Redis's per-key overhead (some tens of bytes). Keep the
sum of the quotas below Redis's ``maxmemory`` so Redis never has to evict for
kvtier (its eviction is not per tenant).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis, RedisCluster

from kvtier.cacheserver.tiers import TierUsage

LEDGER_PREFIX = b"kvtier:v1q:"
TENANTS = LEDGER_PREFIX + b"tenants"

# KEYS: lru, size, bytes. ARGV: key, record bytes, now (ms), quota.
# Returns {tenant bytes, tenant entries, evicted keys...}.
_CHARGE = """
local old = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local used = redis.call('INCRBY', KEYS[3], tonumber(ARGV[2]) - old)
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
local quota = tonumber(ARGV[4])
local out = {0, 0}
while used > quota do
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 1)
  local victim = oldest[1]
  if victim == ARGV[1] then victim = oldest[2] end
  if not victim then break end
  local size = tonumber(redis.call('HGET', KEYS[2], victim) or '0')
  redis.call('ZREM', KEYS[1], victim)
  redis.call('HDEL', KEYS[2], victim)
  used = redis.call('DECRBY', KEYS[3], size)
  table.insert(out, victim)
end
out[1] = used
out[2] = redis.call('ZCARD', KEYS[1])
return out
"""

# KEYS: lru, size, bytes. ARGV: keys. Returns {tenant bytes, tenant entries}.
_DISCHARGE = """
local freed = 0
for _, key in ipairs(ARGV) do
  local size = redis.call('HGET', KEYS[2], key)
  if size then
    freed = freed + tonumber(size)
    redis.call('HDEL', KEYS[2], key)
    redis.call('ZREM', KEYS[1], key)
  end
end
local used = redis.call('DECRBY', KEYS[3], freed)
return {used, redis.call('ZCARD', KEYS[1])}
"""


def _keys(tenant: str) -> list[bytes]:
    tag = LEDGER_PREFIX + b"{" + tenant.encode() + b"}:"
    return [tag + b"lru", tag + b"size", tag + b"bytes"]


def _now_ms() -> int:
    return int(time.time() * 1000)


class TenantLedger:
    """Charges records to tenants within ``quota_bytes`` each; keeps the last figures seen."""

    def __init__(self, client: Redis | RedisCluster, quota_bytes: int) -> None:
        self.quota_bytes = quota_bytes
        self._client = client
        self._charge = client.register_script(_CHARGE)
        self._discharge = client.register_script(_DISCHARGE)
        self.usage: dict[str, TierUsage] = {}  # the last figures seen, per tenant

    def _seen(self, tenant: str, used: int, entries: int) -> None:
        self.usage[tenant] = TierUsage(max(0, int(used)), self.quota_bytes, int(entries))

    async def charge(self, tenant: str, key: bytes, size: int) -> list[bytes]:
        """Charges ``size`` bytes for ``key`` to ``tenant``; returns its keys evicted for them."""
        out: list[Any] = await self._charge(
            keys=_keys(tenant), args=[key, size, _now_ms(), self.quota_bytes]
        )
        self._seen(tenant, out[0], out[1])
        return [bytes(k) for k in out[2:]]

    async def discharge(self, tenant: str, keys: Sequence[bytes]) -> None:
        out: list[Any] = await self._discharge(keys=_keys(tenant), args=list(keys))
        self._seen(tenant, out[0], out[1])

    def touch(self, pipe: Any, tenant: str, key: bytes) -> None:
        """Queues marking ``key`` used (if it is on the ledger) on a pipeline."""
        pipe.zadd(_keys(tenant)[0], {key: _now_ms()}, xx=True)

    def register(self, pipe: Any, tenant: str) -> None:
        pipe.sadd(TENANTS, tenant)

    async def refresh(self) -> None:
        """Reads every tenant's bytes and entries (what other replicas charged too)."""
        members = await self._client.smembers(TENANTS)  # decode_responses is off: bytes
        tenants = sorted(t.decode() if isinstance(t, bytes) else t for t in members)
        if not tenants:
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                lru, _, used = _keys(tenant)
                pipe.get(used)
                pipe.zcard(lru)
            replies: list[Any] = await pipe.execute()
        for i, tenant in enumerate(tenants):
            self._seen(tenant, int(replies[2 * i] or 0), int(replies[2 * i + 1] or 0))
