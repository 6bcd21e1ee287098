"""The Redis tier: values in a Redis server or a Redis Cluster, through ``redis.asyncio``
and, for the values themselves on a standalone server without TLS, the tier's own
clients (``kvtier.cacheserver.redis_bulk``: no copy of a value in Python): every ``GET``
(but with a tenant quota, whose ``GET`` marks the key used on the ledger in the same
round trip, through redis-py) and a ``SET`` of a record under ``BULK_SET_THREAD_MIN`` on
the event loop, a larger ``SET`` in a worker thread.

Where the tier connects is one URL::

    redis://[[user]:password@]host[:port][/db]         TCP
    rediss://[[user]:password@]host[:port][/db]        TCP + TLS
    unix://[[user]:password@]/path/to/redis.sock[?db=N] unix socket
    redis+cluster://[[user]:password@]host:port[,host:port...]   Redis Cluster
    rediss+cluster://[[user]:password@]host:port[,host:port...]  Redis Cluster + TLS

A cluster URL names one or more seed nodes; the client discovers the rest and
follows the cluster through failovers. The password may sit in the URL or come
from the ``password`` argument (``--redis-password`` / ``KVTIER_REDIS_PASSWORD``),
which wins. TLS checks the server's certificate against ``tls_ca_file`` (the
system store when unset) and its host name; ``tls_cert_file``/``tls_key_file``
present a client certificate to servers that ask for one.

Storage: a value is one Redis string, the record of ``kvtier.cacheserver.record``
(header + key + value), under ``KEY_PREFIX + key``. ``SET`` replaces a value
atomically; with ``ttl_s`` it also expires. A record that fails verification
(flipped bits, truncated, another key's record, garbage) is deleted, counted and
served as a miss (a good value written between that read and the delete is
lost too: one extra miss). Redis keeps its own capacity: it evicts by its
``maxmemory-policy`` (use ``allkeys-lru`` for a cache), and a server that
refuses writes when full (``noeviction``) makes ``put`` return False. Redis caps
one value at ``proto-max-bulk-len`` (512 MB by default); records larger than
``MAX_RECORD_BYTES`` are refused without a round trip.

Failures: every network step (connecting, sending a command, reading its reply)
is bounded by ``timeout_s``, so a stopped or unreachable Redis raises
``TierFailure`` after about ``timeout_s``; a refused connection raises at once.
The bound covers a whole value's transfer too: size it for the largest value
under load (64 MiB takes ~45 ms on an idle loopback, several times that on a
busy host).
Connections are re-made on the next call, so the tier recovers by itself when
Redis comes back. Errors carry only the exception type, never keys or values.

Per-tenant quotas (``tenant_quota_bytes``, ``--tenant-quota-bytes``): each
tenant's records are charged to it in a ledger kept in Redis
(``kvtier.cacheserver.redis_quota``); a tenant over its quota loses its own
least recently used entries, never another's. Without a quota nothing is
charged and ``tenant_usage`` is zero (Redis is not asked per tenant).

Usage (``usage()``) is what Redis reports about the whole server (cluster: the
sum over primaries), not only kvtier's keys: ``used_bytes`` is ``used_memory``,
``capacity_bytes`` is ``maxmemory`` (0 when unset), ``entries`` the number of keys
in the database, and ``counters.evictions`` grows with Redis's ``evicted_keys``.
They are read with ``INFO`` by ``ping()`` and, after Gets, Puts and Deletes, in the
background at most every ``stats_interval_s`` (the last calls before the tier goes idle
are in a read too, at most that long after them); before the first read they are 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from redis.asyncio import ConnectionPool, Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    OutOfMemoryError,
    RedisClusterException,
    RedisError,
)

from kvtier.cacheserver import record
from kvtier.cacheserver.errors import SettingsError, TierFailure
from kvtier.cacheserver.namespace import tenant_of
from kvtier.cacheserver.record import CorruptRecord
from kvtier.cacheserver.redis_bulk import BulkClient, LoopClient, RedisReplyError
from kvtier.cacheserver.redis_quota import TenantLedger
from kvtier.cacheserver.tiers import TierCounters, TierUsage

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

KEY_PREFIX = b"kvtier:v1:"
MAX_RECORD_BYTES = 512 * 1024 * 1024  # Redis's default proto-max-bulk-len
# Threads of the blocking client (``redis_bulk.BulkClient``): SETs in flight at once, each
# on a connection of its own; a paused Redis holds each for up to ``timeout_s``.
BULK_THREADS = 16
# Records this large or larger are SET from a worker thread, where one ``sendmsg`` copies
# the value into the socket without the GIL; smaller ones on the event loop, where no hop
# to a thread and back adds to a call's latency (docs/benchmarks.md, "The Redis tier's
# calls on the event loop": on the loop 1 MiB SETs gained, 16-64 MiB ones lost 5-20%).
BULK_SET_THREAD_MIN = 8 << 20
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")

# Everything redis-py or the tier's own client (``redis_bulk``) raises for a failed call
# (RedisClusterException is not a RedisError; the own client's are OSErrors but for one).
_REDIS_ERRORS = (RedisError, RedisClusterException, OSError, RedisReplyError)


class RedisTier:
    """A ``Tier`` on Redis (standalone, TLS, unix socket or Cluster); see the module docstring."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        password: str | None = None,
        timeout_s: float = 0.5,
        ttl_s: int = 0,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        stats_interval_s: float = 10.0,
        tenant_quota_bytes: int = 0,
    ) -> None:
        if timeout_s <= 0:
            raise SettingsError(f"redis timeout must be > 0 seconds, got {timeout_s}")
        if ttl_s < 0:
            raise SettingsError(f"redis TTL must be >= 0 seconds (0: no expiry), got {ttl_s}")
        self.counters = TierCounters()
        self.ttl_s = ttl_s
        self.stats_interval_s = stats_interval_s
        self._usage = TierUsage(used_bytes=0, capacity_bytes=0, entries=0)
        self._evicted_seen: dict[str, int] = {}
        self._stats_at = -float("inf")
        self._stats_stale = False  # a call since the last read began
        self._closing = False  # close() began: no more stats reads
        self._stats_task: asyncio.Task[None] | None = None

        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme not in SCHEMES:
            # The URL itself is not echoed: it may hold a password.
            raise SettingsError(
                f"redis URL: unknown scheme {scheme!r}; accepted: "
                + ", ".join(f"{s}://" for s in SCHEMES)
            )
        tls = scheme.startswith("rediss")
        if not tls and (tls_ca_file or tls_cert_file or tls_key_file):
            raise SettingsError("redis TLS files need a rediss:// or rediss+cluster:// URL")
        options: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "client_name": "kvtier",
        }
        if password is not None:
            options["password"] = password
        if tls:
            options.update(
                ssl_ca_certs=tls_ca_file, ssl_certfile=tls_cert_file, ssl_keyfile=tls_key_file
            )
        self.cluster = scheme.endswith("+cluster")
        self._client: Redis | RedisCluster
        # Values go through the tier's own clients where they can (``redis_bulk``).
        self._values: LoopClient | None = None
        self._bulk: BulkClient | None = None
        self._threads: ThreadPoolExecutor | None = None
        if self.cluster:
            self._client = _cluster_client(url, tls, options)
            self._db = 0
        else:
            self._client, kwargs = _standalone_client(url, options)
            self._db = int(kwargs.get("db", 0) or 0)
            if not tls:
                self._values = LoopClient.from_url_kwargs(kwargs, timeout_s)
                self._bulk = BulkClient.from_url_kwargs(kwargs, timeout_s)
                self._threads = ThreadPoolExecutor(BULK_THREADS, thread_name_prefix="kvtier-redis")
        self.ledger = TenantLedger(self._client, tenant_quota_bytes) if tenant_quota_bytes else None

    # --- the Tier protocol ---------------------------------------------------

    async def get(self, key: bytes) -> bytes | memoryview | None:
        try:
            value = await self._fetch(key)
        except _REDIS_ERRORS as exc:
            raise _failure("GET", exc) from exc
        except CorruptRecord as exc:
            self._maybe_refresh_stats()
            self.counters.verification_failures += 1
            self.counters.miss(key)
            logger.warning("redis tier: deleted a record that failed verification (%s)", exc)
            try:
                await self._client.delete(KEY_PREFIX + key)
            except _REDIS_ERRORS as del_exc:
                raise _failure("DEL", del_exc) from del_exc
            return None
        self._maybe_refresh_stats()
        if value is None:
            self.counters.miss(key)
            return None
        self.counters.hit(key)
        return value

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        found = await self._per_key("EXISTS", keys)
        return [n == 1 for n in found]

    async def put(self, key: bytes, value: bytes | memoryview) -> bool:
        size = record.HEADER_SIZE + len(key) + memoryview(value).nbytes
        capacity = self._usage.capacity_bytes
        if size > MAX_RECORD_BYTES or (capacity and size > capacity):
            return False
        if self.ledger is not None and size > self.ledger.quota_bytes:
            return False
        victims = await self._charge(key, size)
        try:
            if self._values is None:
                stored = await self._redis_py_set(key, value)
            elif size >= BULK_SET_THREAD_MIN:
                stored = await self._in_thread(self._bulk_set, key, value)
            else:
                parts = (record.header(key, value), value)
                stored = await self._values.set(KEY_PREFIX + key, parts, self.ttl_s)
        except _REDIS_ERRORS as exc:
            await self._discharge_quietly(key)
            raise _failure("SET", exc) from exc
        if not stored:
            logger.debug("redis tier: Redis is full and does not evict; value not stored")
            await self._discharge_quietly(key)
            return False
        if self.ledger is not None:
            await self._evict(key, victims)
        self._maybe_refresh_stats()
        return True

    async def delete(self, keys: Sequence[bytes]) -> int:
        deleted = sum(await self._per_key("DEL", keys))
        self._maybe_refresh_stats()
        if self.ledger is not None:
            by_tenant: dict[str, list[bytes]] = {}
            for key in keys:
                by_tenant.setdefault(tenant_of(key), []).append(key)
            try:
                for tenant, own in by_tenant.items():
                    await self.ledger.discharge(tenant, own)
            except _REDIS_ERRORS as exc:
                raise _failure("EVALSHA", exc) from exc
        return deleted

    def usage(self) -> TierUsage:
        return self._usage

    def tenant_usage(self, tenant: str) -> TierUsage:
        """The tenant's charged bytes and entries (as last seen); zero without a quota."""
        if self.ledger is None:
            return TierUsage(0, 0, 0)
        return self.ledger.usage.get(tenant) or TierUsage(0, self.ledger.quota_bytes, 0)

    def tenant_usages(self) -> dict[str, TierUsage]:
        return {} if self.ledger is None else dict(self.ledger.usage)

    async def ping(self) -> None:
        """Checks that Redis answers and refreshes ``usage()`` and ``counters.evictions``."""
        await self._refresh_stats()

    async def close(self) -> None:
        self._closing = True
        if self._stats_task is not None:
            self._stats_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats_task
        if self._values is not None:
            self._values.close()
        if self._bulk is not None:
            self._bulk.close()
        if self._threads is not None:
            self._threads.shutdown(wait=False)
        await self._client.aclose()

    # --- internals -----------------------------------------------------------

    async def _fetch(self, key: bytes) -> memoryview | None:
        """The value of ``key``, its record checked (``CorruptRecord``); None when unset."""
        blob: bytes | memoryview | None
        if self._values is not None and self.ledger is None:
            blob = await self._values.get(KEY_PREFIX + key)
        elif self.ledger is None:  # decode_responses is off: replies are bytes
            blob = cast(bytes | None, await self._client.get(KEY_PREFIX + key))
        else:  # one round trip: the value, and its key marked used on the ledger
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.get(KEY_PREFIX + key)
                self.ledger.touch(pipe, tenant_of(key), key)
                blob = cast(bytes | None, (await pipe.execute())[0])
        return None if blob is None else record.decode(key, blob)

    async def _in_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        assert self._threads is not None
        try:
            return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)
        except RuntimeError as exc:  # its threads are shut down: the tier was closed
            raise ConnectionError("the Redis tier is closed") from exc

    def _bulk_set(self, key: bytes, value: bytes | memoryview) -> bool:
        """``SET`` of ``key``'s record on the blocking client, in a worker thread (the
        record's checksum computed there too); False when Redis is full."""
        assert self._bulk is not None
        return self._bulk.set(KEY_PREFIX + key, (record.header(key, value), value), self.ttl_s)

    async def _redis_py_set(self, key: bytes, value: bytes | memoryview) -> bool:
        try:
            await self._client.set(
                KEY_PREFIX + key, record.header(key, value) + value, ex=self.ttl_s or None
            )
        except OutOfMemoryError:
            return False
        return True

    async def _charge(self, key: bytes, size: int) -> list[bytes]:
        """Charges a record to its tenant (with a quota); returns the tenant's keys to evict."""
        if self.ledger is None:
            return []
        try:
            return await self.ledger.charge(tenant_of(key), key, size)
        except _REDIS_ERRORS as exc:
            raise _failure("EVALSHA", exc) from exc

    async def _discharge_quietly(self, key: bytes) -> None:
        """Takes a record that was not stored off the ledger (best effort: a stale charge is
        freed by the tenant's own eviction later)."""
        if self.ledger is not None:
            with contextlib.suppress(*_REDIS_ERRORS):
                await self.ledger.discharge(tenant_of(key), [key])

    async def _evict(self, key: bytes, victims: list[bytes]) -> None:
        """Deletes the values the ledger evicted for ``key``'s tenant, and lists the tenant."""
        assert self.ledger is not None
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                self.ledger.register(pipe, tenant_of(key))
                for victim in victims:
                    pipe.delete(KEY_PREFIX + victim)
                await pipe.execute()
        except _REDIS_ERRORS as exc:
            raise _failure("DEL", exc) from exc
        self.counters.evicted(victims)

    async def _per_key(self, command: str, keys: Sequence[bytes]) -> list[int]:
        """Runs a one-key integer command for each key in one round trip (per node in a cluster)."""
        if not keys:
            return []
        try:
            # Not a transaction: a cluster pipeline spreads the keys over their nodes.
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.execute_command(command, KEY_PREFIX + key)
                results: list[int] = await pipe.execute()
        except _REDIS_ERRORS as exc:
            raise _failure(command, exc) from exc
        return results

    def _maybe_refresh_stats(self) -> None:
        """Marks the stats stale after a call, and starts the background task that reads
        them (``INFO``) unless it runs: at once when the last read is older than
        ``stats_interval_s``, else once that interval is up. So a burst of calls costs one
        read per interval, and the last calls of a burst are in a read too (an idle tier
        shows what it held when it went idle, not what it held at the burst's first call)."""
        self._stats_stale = True
        if self._closing:  # a call that ended after close(): its client is closed
            return
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.create_task(self._refresh_stats_while_stale())

    async def _refresh_stats_while_stale(self) -> None:
        while self._stats_stale:
            wait = self._stats_at + self.stats_interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._stats_stale = False  # calls from here on come after this read: another
            self._stats_at = time.monotonic()  # one attempt per interval, even when it fails
            with contextlib.suppress(TierFailure):
                await self._refresh_stats()

    async def _refresh_stats(self) -> None:
        try:
            if isinstance(self._client, RedisCluster):
                per_node = await self._client.info(
                    "memory", "stats", "keyspace", target_nodes=RedisCluster.PRIMARIES
                )
            else:
                per_node = {"server": await self._client.info("memory", "stats", "keyspace")}
        except _REDIS_ERRORS as exc:
            raise _failure("INFO", exc) from exc
        self._stats_at = time.monotonic()
        used = capacity = entries = 0
        unbounded = False
        for node, info in per_node.items():
            used += int(info.get("used_memory", 0))
            maxmemory = int(info.get("maxmemory", 0))
            unbounded = unbounded or maxmemory == 0
            capacity += maxmemory
            db = info.get(f"db{self._db}")
            entries += int(db.get("keys", 0)) if isinstance(db, dict) else 0
            evicted = int(info.get("evicted_keys", 0))
            seen = self._evicted_seen.get(node, 0)
            # A restarted server counts from 0 again: everything it reports is new.
            self.counters.evictions += evicted - seen if evicted >= seen else evicted
            self._evicted_seen[node] = evicted
        self._usage = TierUsage(
            used_bytes=used, capacity_bytes=0 if unbounded else capacity, entries=entries
        )
        if self.ledger is not None:
            try:
                await self.ledger.refresh()
            except _REDIS_ERRORS as exc:
                raise _failure("SMEMBERS", exc) from exc


def _failure(op: str, exc: BaseException) -> TierFailure:
    # Only the type: redis-py's messages may quote a command with its key.
    return TierFailure("redis", f"{op} failed ({type(exc).__name__})")


def _standalone_client(url: str, options: dict[str, Any]) -> tuple[Redis, dict[str, Any]]:
    """redis-py's client for a standalone server, and what it was made from."""
    try:
        kwargs: dict[str, Any] = dict(parse_url(url))
    except ValueError as exc:
        raise SettingsError(f"redis URL: {exc}") from None
    kwargs.update(options)
    if kwargs.get("connection_class") is not SSLConnection:
        for tls_option in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            kwargs.pop(tls_option, None)
    # One immediate retry on a broken connection (a restarted server leaves stale sockets
    # in the pool); none on a timeout, which would only double the wait.
    kwargs["retry"] = Retry(NoBackoff(), retries=1, supported_errors=(RedisConnectionError,))
    pool = ConnectionPool(**kwargs)
    return Redis.from_pool(pool), kwargs


def _cluster_client(url: str, tls: bool, options: dict[str, Any]) -> RedisCluster:
    scheme, _, rest = url.partition("://")
    netloc, sep, tail = _split_netloc(rest)
    userinfo, _, hosts = netloc.rpartition("@")
    nodes = [_host_port(h) for h in hosts.split(",") if h]
    if not nodes:
        raise SettingsError(f"redis URL: {scheme}:// needs at least one host:port seed node")
    # parse_url reads the credentials and query options of the first seed.
    host, port = nodes[0]
    first = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    seed_url = f"{'rediss' if tls else 'redis'}://{userinfo + '@' if userinfo else ''}{first}"
    try:
        kwargs: dict[str, Any] = dict(parse_url(seed_url + sep + tail))
    except ValueError as exc:
        raise SettingsError(f"redis URL: {exc}") from None
    for single_node_option in ("host", "port", "db", "connection_class"):
        kwargs.pop(single_node_option, None)
    kwargs.update(options)
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in nodes],
        ssl=tls,
        # One retry after re-reading the cluster's topology (a failed-over primary).
        retry=Retry(NoBackoff(), retries=1),
        **kwargs,
    )


def _split_netloc(rest: str) -> tuple[str, str, str]:
    """Splits ``netloc/path?query`` into netloc, the separator and what follows it."""
    for i, ch in enumerate(rest):
        if ch in "/?":
            return rest[:i], ch, rest[i + 1 :]
    return rest, "", ""


def _host_port(hostport: str) -> tuple[str, int]:
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise SettingsError("redis URL: cluster seed nodes are host:port, comma-separated")
    return host.strip("[]"), int(port)
