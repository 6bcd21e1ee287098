"""The tiered store: RAM -> disk -> Redis, with promotion, write-behind and degradation.

Reads walk the tiers top-down; a hit in a lower tier is promoted (copied up) so
the next read is faster (not a hit a same-node client reads from its record file
itself, ``get(files=True)``: the page cache holds it, and promoting would read the
value the client reads). Writes land in the first tier (RAM) at once and are
written behind to the lower tiers by one background task per tier, through a
bounded pending set (full: the copy is dropped and counted, the RAM copy
stays). With ``write_through`` a Put returns only once every healthy tier holds
the value.

A lower tier that fails (an I/O error, Redis down, or slower than
``tier_timeout_s``) is marked unhealthy: the failure is logged once and
counted, calls skip it, and a prober pings it every ``probe_interval_s`` until
it answers again. A failing tier therefore costs a miss (a recompute in the
engine), never a failed call.

A Delete waits for a write-behind copy of one of its keys that is already
being written (the copy would land after it and bring the value back), then
deletes it from that tier too: once a Delete returns, no tier serves the value
again, now or after a restart.

A Delete that cannot reach a failing tier is remembered (up to
``MAX_PENDING_DELETES`` keys per tier, oldest dropped and counted first) and
replayed when the tier answers again, before it serves any read: a deleted
value does not come back from a tier that was down when it was deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from kvtier.cacheserver.errors import TierFailure
from kvtier.cacheserver.metrics import ServerMetrics
from kvtier.cacheserver.ram import RamTier
from kvtier.cacheserver.record import RecordFile
from kvtier.cacheserver.tiers import CheckedWriteTier, FileTier, Tier

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Keys of Deletes a failing tier missed, kept per tier for replay on recovery
# (~100 bytes each with their dict entry: at most ~25 MiB per tier).
MAX_PENDING_DELETES = 1 << 18
REPLAY_BATCH = 1024


@dataclass(frozen=True)
class StorePolicy:
    write_through: bool = False
    # Bounds of each lower tier's write-behind pending set.
    write_behind_values: int = 1024
    write_behind_bytes: int = 256 << 20
    tier_timeout_s: float = 1.0
    probe_interval_s: float = 1.0
    promote: bool = True


class _Skip(Exception):
    """The tier is unhealthy or just failed: behave as if it had nothing."""


class _WriteBehind:
    """Values waiting to be copied into one lower tier (newest value per key wins)."""

    def __init__(self, max_values: int, max_bytes: int) -> None:
        self.pending: OrderedDict[bytes, bytes | memoryview] = OrderedDict()
        self.bytes = 0
        self.max_values = max_values
        self.max_bytes = max_bytes
        self.wakeup = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        # The copy being written now (taken from ``pending``), and set when none is.
        self.inflight: bytes | None = None
        self.inflight_value: bytes | memoryview | None = None
        self.landed = asyncio.Event()
        self.landed.set()

    def offer(self, key: bytes, value: bytes | memoryview) -> bool:
        size = memoryview(value).nbytes
        old = self.pending.pop(key, None)
        if old is not None:
            self.bytes -= memoryview(old).nbytes
        if len(self.pending) >= self.max_values or self.bytes + size > self.max_bytes:
            return False
        self.pending[key] = value
        self.bytes += size
        self.idle.clear()
        self.wakeup.set()
        return True

    def held(self, key: bytes) -> bytes | memoryview | None:
        """The value of ``key`` waiting for or being written to the tier (the newest), if any."""
        value = self.pending.get(key)
        if value is None and self.inflight == key:
            value = self.inflight_value
        return value

    def discard(self, key: bytes) -> None:
        old = self.pending.pop(key, None)
        if old is not None:
            self.bytes -= memoryview(old).nbytes

    def take(self) -> tuple[bytes, bytes | memoryview] | None:
        if not self.pending:
            return None
        key, value = self.pending.popitem(last=False)
        self.bytes -= memoryview(value).nbytes
        return key, value


class TieredStore:
    def __init__(self, tiers: Sequence[Tier], policy: StorePolicy, metrics: ServerMetrics) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = list(tiers)
        self.policy = policy
        self.metrics = metrics
        self._healthy = {t.name: True for t in self.tiers}
        # checked once: an isinstance of a Protocol costs as much as opening a record file
        self._file_tiers = {t.name: t for t in self.tiers if isinstance(t, FileTier)}
        self._checked_tiers = {t.name: t for t in self.tiers if isinstance(t, CheckedWriteTier)}
        # A RAM tier on top never waits (no await in it): its calls get no deadline, which
        # cost a timer per key
        self._untimed = self.tiers[0] if isinstance(self.tiers[0], RamTier) else None
        self._behind = {
            t.name: _WriteBehind(policy.write_behind_values, policy.write_behind_bytes)
            for t in self.tiers[1:]
        }
        # Deletes each lower tier missed while failing, replayed before it serves again.
        self._deletes: dict[str, OrderedDict[bytes, None]] = {t.name: OrderedDict() for t in self.tiers[1:]}
        # Exported from the start, zero: a dashboard's rate() has samples before the first
        # event, so a panel shows 0, not "No data" (nor nothing until two scrapes after it).
        for name in self._deletes:
            metrics.pending_deletes.labels(name).set(0)
            metrics.deletes_dropped.labels(name)
            metrics.write_behind_dropped.labels(name)
        for tier in self.tiers[:-1]:  # the tiers a hit below them is promoted into
            metrics.promotions.labels(tier.name)
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        for tier in self.tiers[1:]:
            self._tasks.append(asyncio.create_task(self._write_behind_loop(tier)))
        self._tasks.append(asyncio.create_task(self._probe_loop()))

    async def drain(self, timeout_s: float) -> bool:
        """Waits until every write-behind copy is done; False on timeout."""
        waits = [wb.idle.wait() for wb in self._behind.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for tier in self.tiers:
            with contextlib.suppress(Exception):
                await tier.close()

    def is_healthy(self, tier_name: str) -> bool:
        return self._healthy.get(tier_name, False)

    def write_behind_depth(self) -> int:
        return sum(len(wb.pending) for wb in self._behind.values())

    def receive_buffer(self, size: int, tenant: str) -> bytearray | memoryview:
        """A buffer to receive a value of ``size`` bytes of ``tenant``'s into: recycled by the
        RAM tier if it can.

        Fill it whole before ``put``: a recycled buffer still holds an old value's bytes.
        """
        top = self.tiers[0]
        return top.receive_buffer(size, tenant) if isinstance(top, RamTier) else bytearray(size)

    # -- operations ---------------------------------------------------------------

    async def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are present in some tier."""
        present = [False] * len(keys)
        first_missing = 0
        for tier in self.tiers:
            first_missing = _leading(present, first_missing)
            if first_missing == len(keys):
                break
            todo = [i for i in range(first_missing, len(keys)) if not present[i]]
            pending = self._behind.get(tier.name)
            # Copies on their way to this tier, asked before it (as ``get`` does).
            held = {i for i in todo if pending is not None and pending.held(keys[i]) is not None}
            try:
                found = await self._call(tier, "contains", partial(tier.contains, [keys[i] for i in todo]))
            except _Skip:
                found = [False] * len(todo)
            for i, hit in zip(todo, found, strict=True):
                if hit or i in held:
                    present[i] = True
        return _leading(present, 0)

    async def get(self, key: bytes, *, files: bool = False) -> bytes | memoryview | RecordFile | None:
        """The newest value of ``key``, or None. ``files``: a hit in a tier that keeps
        values in files (the disk tier) is that record's file, opened, not read (the
        caller closes it) and not promoted."""
        for depth, tier in enumerate(self.tiers):
            # A copy on its way to this tier is the newest: asked before the tier, so a copy
            # that lands while the tier is read is found in one or the other, never missed.
            pending = self._behind.get(tier.name)
            held = pending.held(key) if pending is not None else None
            if held is not None:
                return held
            file_tier = self._file_tiers.get(tier.name) if files else None
            if file_tier is not None:
                with contextlib.suppress(_Skip):
                    opened = await self._call(tier, "get", partial(file_tier.open_record, key))
                    if opened is not None:
                        return opened
                continue
            try:
                value: bytes | memoryview | None = await self._call(tier, "get", partial(tier.get, key))
            except _Skip:
                value = None
            if value is None:
                continue
            if depth and self.policy.promote:
                await self._promote(key, value, depth)
            return value
        return None

    async def put(self, key: bytes, value: bytes | memoryview) -> bool:
        """Stores a value; False when no tier would take it (larger than every tier)."""
        top = self.tiers[0]
        stored = False
        with contextlib.suppress(_Skip):
            stored = await self._call(top, "put", partial(top.put, key, value))
        for tier in self.tiers[1:]:
            if self.policy.write_through:
                with contextlib.suppress(_Skip):
                    stored = await self._call(tier, "put", partial(tier.put, key, value)) or stored
            elif self._healthy[tier.name]:
                if self._behind[tier.name].offer(key, value):
                    stored = True
                else:
                    self.metrics.write_behind_dropped.labels(tier.name).inc()
        self.metrics.write_behind_depth.set(self.write_behind_depth())
        return stored

    def writes_checked(self, size: int) -> bool:
        """Whether ``put_checked`` stores a value of ``size`` bytes (rather than answer None)."""
        return self._checked_writer(size) is not None

    def _checked_writer(self, size: int) -> Tier | None:
        top = self.tiers[0]
        takers = self.tiers[1:] if isinstance(top, RamTier) and not top.lru.fits(size) else self.tiers
        if len(takers) != 1 or takers[0].name not in self._checked_tiers:
            return None
        tier = takers[0]
        if tier is not top and not self.policy.write_through:
            return None
        return tier

    async def put_checked(self, key: bytes, source: memoryview, checksum: int) -> bool | None:
        """Stores a value straight from ``source``, memory its sender can still change, when
        one tier alone would store it and can check it as it writes it (``CheckedWriteTier``:
        the RAM tier does not take values that large, and the one lower tier is written
        through); None when not (the caller copies the value first, checks it, then ``put``).
        ``ChecksumMismatch`` from the tier when what it wrote does not match ``checksum``."""
        tier = self._checked_writer(source.nbytes)
        if tier is None:
            return None
        top = self.tiers[0]
        put = self._checked_tiers[tier.name].put_checked
        try:
            stored = await self._call(tier, "put", partial(put, key, source, checksum))
        except _Skip:
            return False
        if stored and tier is not top:
            await top.delete([key])  # an older, smaller value of the key must not be served
        return stored

    async def delete(self, keys: Sequence[bytes]) -> int:
        deleted = 0
        for tier in self.tiers:
            wb = self._behind.get(tier.name)
            if wb is not None:
                for key in keys:
                    wb.discard(key)
                if wb.inflight is not None and wb.inflight in set(keys):
                    await wb.landed.wait()  # a copy already being written lands first, then goes
            try:
                n = await self._call(tier, "delete", partial(tier.delete, keys))
            except _Skip:
                self._remember_deletes(tier, keys)
                continue
            deleted = max(deleted, n)
        return deleted

    def pending_deletes(self, tier_name: str) -> int:
        return len(self._deletes.get(tier_name, ()))

    # -- internals ----------------------------------------------------------------

    def _remember_deletes(self, tier: Tier, keys: Sequence[bytes]) -> None:
        pending = self._deletes.get(tier.name)
        if pending is None:
            return
        for key in keys:
            pending[key] = None
            pending.move_to_end(key)
        dropped = 0
        while len(pending) > MAX_PENDING_DELETES:
            pending.popitem(last=False)
            dropped += 1
        if dropped:
            self.metrics.deletes_dropped.labels(tier.name).inc(dropped)
            logger.warning(
                "%s tier: more than %d Deletes waiting for it to recover; the oldest %d will not be "
                "replayed (those values can be served again once it recovers)",
                tier.name,
                MAX_PENDING_DELETES,
                dropped,
            )
        self.metrics.pending_deletes.labels(tier.name).set(len(pending))

    async def _replay_deletes(self, tier: Tier) -> None:
        """Deletes in ``tier`` what was deleted while it was failing (raises if it fails again)."""
        pending = self._deletes.get(tier.name)
        while pending:
            batch = list(itertools.islice(pending, REPLAY_BATCH))
            await asyncio.wait_for(tier.delete(batch), self.policy.tier_timeout_s)
            for key in batch:
                pending.pop(key, None)
            self.metrics.pending_deletes.labels(tier.name).set(len(pending))

    async def _call(self, tier: Tier, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        if not self._healthy[tier.name]:
            raise _Skip
        try:
            if tier is self._untimed:
                return await fn()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs ``fn`` in a task
            # of its own (one more trip around the event loop for every key in every tier
            # asked), where this runs it in the caller's task and costs one timer
            async with asyncio.timeout(self.policy.tier_timeout_s):
                return await fn()
        except (TierFailure, TimeoutError, OSError) as exc:
            self._mark_failed(tier, op, exc)
            raise _Skip from exc

    def _mark_failed(self, tier: Tier, op: str, exc: BaseException) -> None:
        self.metrics.tier_errors.labels(tier.name, op).inc()
        if tier is self.tiers[0]:
            return  # RAM does not fail; never take the top tier out
        if self._healthy[tier.name]:
            self._healthy[tier.name] = False
            reason = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            logger.warning(
                "%s tier failing (%s during %s): serving from the other tiers until it recovers",
                tier.name,
                reason,
                op,
            )
            # Pending copies would only pile up; they are dropped, not replayed.
            wb = self._behind.get(tier.name)
            if wb is not None:
                wb.pending.clear()
                wb.bytes = 0
                wb.idle.set()

    async def _promote(self, key: bytes, value: bytes | memoryview, depth: int) -> None:
        for tier in self.tiers[:depth]:
            if tier is self.tiers[0]:
                try:
                    if await self._call(tier, "put", partial(tier.put, key, value)):
                        self.metrics.promotions.labels(tier.name).inc()
                except _Skip:
                    pass
            elif self._healthy[tier.name] and self._behind[tier.name].offer(key, value):
                self.metrics.promotions.labels(tier.name).inc()

    async def _write_behind_loop(self, tier: Tier) -> None:
        wb = self._behind[tier.name]
        while True:
            item = wb.take()
            if item is None:
                wb.idle.set()
                self.metrics.write_behind_depth.set(self.write_behind_depth())
                wb.wakeup.clear()
                await wb.wakeup.wait()
                continue
            key, value = item
            wb.inflight, wb.inflight_value = key, value
            wb.landed.clear()
            try:
                with contextlib.suppress(_Skip):
                    await self._call(tier, "put", partial(tier.put, key, value))
            finally:
                wb.inflight = wb.inflight_value = None
                wb.landed.set()
            del item, value

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.policy.probe_interval_s)
            for tier in self.tiers:
                if self._healthy[tier.name]:
                    continue
                try:
                    await asyncio.wait_for(tier.ping(), self.policy.tier_timeout_s)
                    await self._replay_deletes(tier)
                except (TierFailure, TimeoutError, OSError):
                    continue
                self._healthy[tier.name] = True
                logger.warning("%s tier recovered: serving from it again", tier.name)


def _leading(present: list[bool], start: int) -> int:
    i = start
    while i < len(present) and present[i]:
        i += 1
    return i
