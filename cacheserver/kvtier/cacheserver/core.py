"""The tier's request core: what every call means, whichever transport carried it.

Each edge (the gRPC servicer ``kvtier.cacheserver.servicer``, the data port
``kvtier.cacheserver.dataport``, and any later one, such as a same-node
shared-memory transport) only decodes its wire format into calls on a
``RequestCore`` and encodes what comes back, and maps the ``RequestError``
classes (``kvtier.cacheserver.errors``) to its own status codes. The core owns
the rest, once:

- tenants: the caller's authorization value -> its tenant (``authenticate``);
  every key is placed into the tenant's namespace here, never by an edge;
- validation and limits: key counts (``--max-keys``), key sizes
  (``--max-key-bytes``), value sizes (``--max-value-bytes``), each error naming
  the field the edge passes in, so a message reads in the edge's vocabulary;
- memory for incoming values: one server-wide ``ReceiveBudget``
  (``--incoming-bytes``, ``kvtier.cacheserver.budget``) that every edge
  reserves from before it allocates what a caller declared;
- the store calls, and the metrics of keys, bytes and answered requests.

The core assumes no stream: a value to store arrives whole (``store``), into
a buffer the core handed out (``receive_buffer``) or any buffer the edge has
(a view into a message, a mapped segment); a Get yields values to send as
(index, value) pairs, each the stored object itself (no copy).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, overload

from kvtier.cacheserver.budget import ReceiveBudget, Reservation
from kvtier.cacheserver.errors import InvalidRequest, LimitExceeded
from kvtier.cacheserver.metrics import ServerMetrics
from kvtier.cacheserver.namespace import DEFAULT_TENANT, scoped
from kvtier.cacheserver.record import RecordFile
from kvtier.cacheserver.settings import Settings
from kvtier.cacheserver.store import TieredStore

# A Get gives the event loop to other connections once per this many keys: a tier call
# that needs no I/O (a RAM hit, a record file opened from the caches) never waits, so a
# Get of thousands of keys would otherwise hold the loop for all of them
YIELD_EVERY_KEYS = 64

# Maps a caller's authorization value ("Bearer <token>", None when it sent none) to its
# tenant; raises Unauthenticated (see kvtier.cacheserver.auth).
Authenticate = Callable[[str | None], str]
Value = bytes | memoryview


def no_auth(_authorization: str | None) -> str:
    """Every caller is the ``default`` tenant (no ``--auth-tokens``)."""
    return DEFAULT_TENANT


@dataclass(frozen=True)
class TierView:
    """One tier as a caller sees it (``Stats``)."""

    name: str
    healthy: bool
    used_bytes: int
    capacity_bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int


@dataclass(frozen=True)
class StatsView:
    """What ``Stats`` answers: the tiers, this server's limits, the caller's tenant."""

    tiers: tuple[TierView, ...]
    max_value_bytes: int
    frame_bytes: int
    max_keys: int
    tenant: str
    data_port: int


class RequestCore:
    """Validation, tenants, limits, store calls and metrics, for every edge."""

    def __init__(
        self,
        store: TieredStore,
        settings: Settings,
        metrics: ServerMetrics,
        authenticate: Authenticate = no_auth,
    ) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.authenticate = authenticate
        self.budget = ReceiveBudget(settings.incoming_bytes)

    # -- tenants and validation ------------------------------------------------------

    def tenant(self, authorization: str | None) -> str:
        """The caller's tenant; raises Unauthenticated."""
        return self.authenticate(authorization)

    def check_count(self, field: str, count: int) -> None:
        if count > self.settings.max_keys:
            raise LimitExceeded(
                f"{field}: {count} keys in one call; this server accepts at most "
                f"{self.settings.max_keys} (--max-keys): split the call"
            )

    def check_key(self, field: str, key: bytes) -> None:
        limit = self.settings.max_key_bytes
        if not key:
            raise InvalidRequest(f"{field}: key of 0 bytes (an empty key); keys are 1..{limit} bytes")
        if len(key) > limit:
            raise InvalidRequest(f"{field}: key of {len(key)} bytes; keys are 1..{limit} bytes")

    def check_keys(self, field: str, keys: Sequence[bytes]) -> None:
        self.check_count(field, len(keys))
        for i, key in enumerate(keys):
            self.check_key(f"{field}[{i}]", key)

    def check_value_length(self, field: str, length: int) -> None:
        if length == 0:
            raise InvalidRequest(f"{field}: must be > 0")
        if length > self.settings.max_value_bytes:
            raise LimitExceeded(
                f"{field}: value of {length} bytes; this server accepts "
                f"at most {self.settings.max_value_bytes} (--max-value-bytes)"
            )

    # -- operations (keys already checked by the edge's parser, or checked here) ------

    async def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        n = await self.store.lookup([scoped(tenant, k) for k in keys])
        self.metrics.lookup_keys.inc(len(keys))
        self.metrics.lookup_hit_keys.inc(n)
        return n

    async def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        return await self.store.delete([scoped(tenant, k) for k in keys])

    def stats(self, tenant: str) -> StatsView:
        """The tiers as ``tenant`` sees them: its own bytes, entries, hits, misses, evictions."""
        tiers = []
        for tier in self.store.tiers:
            c, u = tier.counters.of(tenant), tier.tenant_usage(tenant)
            tiers.append(
                TierView(
                    name=tier.name,
                    healthy=self.store.is_healthy(tier.name),
                    used_bytes=u.used_bytes,
                    capacity_bytes=u.capacity_bytes,
                    entries=u.entries,
                    hits=c.hits,
                    misses=c.misses,
                    evictions=c.evictions,
                )
            )
        return StatsView(
            tiers=tuple(tiers),
            max_value_bytes=self.settings.max_value_bytes,
            frame_bytes=self.settings.frame_bytes,
            max_keys=self.settings.max_keys,
            tenant=tenant,
            data_port=self.settings.data_port,
        )

    @overload
    def get(
        self, tenant: str, keys: Sequence[bytes], stop_at_first_miss: bool, *, files: Literal[0] = 0
    ) -> AsyncGenerator[tuple[int, Value | None], None]: ...

    @overload
    def get(
        self, tenant: str, keys: Sequence[bytes], stop_at_first_miss: bool, *, files: int
    ) -> AsyncGenerator[tuple[int, Value | RecordFile | None], None]: ...

    async def get(
        self, tenant: str, keys: Sequence[bytes], stop_at_first_miss: bool, *, files: int = 0
    ) -> AsyncGenerator[tuple[int, Value | RecordFile | None], None]:
        """Yields (index, value or None) in request order; a value counts as sent once the
        edge asks for the next one. ``files`` (the same-node edge, for a client that reads
        record files itself): up to that many disk-tier hits are their record files,
        opened (``RecordFile``; the edge closes them), later ones values."""
        hits = misses = opened = 0
        try:
            for index, key in enumerate(keys):
                if index % YIELD_EVERY_KEYS == YIELD_EVERY_KEYS - 1:
                    await asyncio.sleep(0)  # a RAM hit never waits: other connections' turn
                value = await self.store.get(scoped(tenant, key), files=opened < files)
                opened += isinstance(value, RecordFile)
                if value is None:
                    misses += 1
                    yield index, None
                    if stop_at_first_miss:
                        return
                    continue
                hits += 1
                yield index, value
                self.metrics.sent_bytes.inc(
                    value.nbytes if isinstance(value, RecordFile) else memoryview(value).nbytes
                )
        finally:
            self.metrics.get_keys.labels("hit").inc(hits)
            self.metrics.get_keys.labels("miss").inc(misses)

    def reserve(self, field: str, size: int) -> Reservation:
        """Reserves memory for ``size`` incoming bytes (a value, a table) before they are
        allocated; raises Overloaded (naming ``field``) when the budget cannot take them."""
        return self.budget.reserve(field, size)

    def receive_buffer(self, length: int, tenant: str) -> bytearray | memoryview:
        """A buffer to receive a value of ``length`` bytes of ``tenant``'s into (recycled when
        the RAM tier has one): fill it whole before ``store``, it may hold an old value's bytes."""
        return self.store.receive_buffer(length, tenant)

    async def store_value(self, tenant: str, key: bytes, value: Value) -> bool:
        """Stores a whole value; False when no tier would take it (larger than every tier)."""
        self.metrics.received_bytes.inc(memoryview(value).nbytes)
        return await self.store.put(scoped(tenant, key), value)

    async def store_checked(self, tenant: str, key: bytes, source: memoryview, checksum: int) -> bool | None:
        """``store_value`` straight from ``source``, memory its sender can still change, where
        one tier alone takes it and checks it as it writes (``Store.put_checked``); None when
        no tier does (copy it, check it, then ``store_value``). ``ChecksumMismatch`` when the
        bytes stored do not match ``checksum`` (nothing stored)."""
        stored = await self.store.put_checked(scoped(tenant, key), source, checksum)
        if stored is not None:
            self.metrics.received_bytes.inc(source.nbytes)
        return stored

    # -- accounting --------------------------------------------------------------------

    def answered(self, op: str, code: str, started: float) -> None:
        """Counts one answered request (``code``: a gRPC status name, as every edge reports)."""
        self.metrics.requests.labels(op, code).inc()
        self.metrics.latency.labels(op).observe(time.perf_counter() - started)
