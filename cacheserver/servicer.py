"""The gRPC servicer: translates kvtier.v1.CacheService calls into store operations.

It validates every request (keys, counts, frame order, sizes), scopes each key
into the caller's tenant namespace, and is the one place that maps the
server's ``RequestError`` classes to gRPC status codes. ``Get`` and ``Put``
move values as raw frames (``kvtier.proto.wire``), without protobuf copies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from kvtier.cacheserver.errors import InvalidRequest, LimitExceeded, RequestError
from kvtier.cacheserver.metrics import ServerMetrics
from kvtier.cacheserver.namespace import DEFAULT_TENANT, scoped
from kvtier.cacheserver.settings import Settings
from kvtier.cacheserver.store import TieredStore
from kvtier.proto import SERVICE_NAME, cache_pb2, wire

logger = logging.getLogger(__name__)

# Maps a call's metadata to its tenant; raises Unauthenticated (see kvtier.cacheserver.auth).
Metadata = Sequence[tuple[str, str | bytes]]
TenantOf = Callable[[Metadata | None], str]

# Put frames may be up to this large (a client chooses its frame size).
MAX_PUT_FRAME_BYTES = 16 << 20


def default_tenant(_metadata: object) -> str:
    return DEFAULT_TENANT


class CacheServicer:
    def __init__(
        self,
        store: TieredStore,
        settings: Settings,
        metrics: ServerMetrics,
        tenant_of: TenantOf = default_tenant,
    ) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.tenant_of = tenant_of

    # -- helpers --------------------------------------------------------------------

    def _keys(self, keys: Sequence[bytes], field: str) -> None:
        if len(keys) > self.settings.max_keys:
            raise LimitExceeded(
                f"{field}: {len(keys)} keys in one call; this server accepts at most "
                f"{self.settings.max_keys} (--max-keys): split the call"
            )
        for i, key in enumerate(keys):
            self._key(key, f"{field}[{i}]")

    def _key(self, key: bytes, field: str) -> None:
        if not key:
            raise InvalidRequest(f"{field}: empty key; keys are 1..{self.settings.max_key_bytes} bytes")
        if len(key) > self.settings.max_key_bytes:
            raise InvalidRequest(
                f"{field}: key of {len(key)} bytes; keys are 1..{self.settings.max_key_bytes} bytes"
            )

    @staticmethod
    def _no_unknown_fields(message: Message) -> None:
        unknown = UnknownFieldSet(message)
        if len(unknown):
            numbers = sorted({unknown[i].field_number for i in range(len(unknown))})
            raise InvalidRequest(
                f"{type(message).__name__} has fields this server does not know (numbers {numbers}): "
                "the client speaks a newer kvtier.v1 contract; upgrade the server"
            )

    # -- unary calls ------------------------------------------------------------------

    async def lookup(self, request: cache_pb2.LookupRequest, tenant: str) -> cache_pb2.LookupResponse:
        self._no_unknown_fields(request)
        keys = list(request.keys)
        self._keys(keys, "LookupRequest.keys")
        n = await self.store.lookup([scoped(tenant, k) for k in keys])
        self.metrics.lookup_keys.inc(len(keys))
        self.metrics.lookup_hit_keys.inc(n)
        return cache_pb2.LookupResponse(prefix_length=n)

    async def delete(self, request: cache_pb2.DeleteRequest, tenant: str) -> cache_pb2.DeleteResponse:
        self._no_unknown_fields(request)
        keys = list(request.keys)
        self._keys(keys, "DeleteRequest.keys")
        n = await self.store.delete([scoped(tenant, k) for k in keys])
        return cache_pb2.DeleteResponse(deleted=n)

    async def stats(self, request: cache_pb2.StatsRequest, tenant: str) -> cache_pb2.StatsResponse:
        self._no_unknown_fields(request)
        tiers = []
        for tier in self.store.tiers:
            c, u = tier.counters, tier.usage()
            tiers.append(
                cache_pb2.TierStats(
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
        return cache_pb2.StatsResponse(
            tiers=tiers,
            max_value_bytes=self.settings.max_value_bytes,
            frame_bytes=self.settings.frame_bytes,
            max_keys_per_request=self.settings.max_keys,
            tenant=tenant,
            data_port=self.settings.data_port,
        )

    # -- streams (raw frames) -------------------------------------------------------

    async def get(self, request: cache_pb2.GetRequest, tenant: str) -> AsyncIterator[bytes]:
        self._no_unknown_fields(request)
        keys = list(request.keys)
        self._keys(keys, "GetRequest.keys")
        frame = self.settings.frame_bytes - wire.FRAME_OVERHEAD
        hits = misses = 0
        try:
            for index, key in enumerate(keys):
                value = await self.store.get(scoped(tenant, key))
                if value is None:
                    misses += 1
                    yield wire.encode_get_frame(index, False, 0, 0, b"")
                    if request.stop_at_first_miss:
                        return
                    continue
                hits += 1
                view = memoryview(value)
                total = view.nbytes
                for offset in range(0, total, frame):
                    yield wire.encode_get_frame(index, True, total, offset, view[offset : offset + frame])
                self.metrics.sent_bytes.inc(total)
        finally:
            self.metrics.get_keys.labels("hit").inc(hits)
            self.metrics.get_keys.labels("miss").inc(misses)

    async def put(self, request_iterator: AsyncIterator[bytes], tenant: str) -> cache_pb2.PutResponse:
        stored = rejected = 0
        key: bytes | None = None
        buf: bytearray | None = None
        total = filled = 0
        async for raw in request_iterator:
            try:
                f = wire.decode_put_frame(raw)
            except wire.WireError as exc:
                raise InvalidRequest(str(exc)) from None
            n = f.data.nbytes
            if f.key:
                if key is not None:
                    raise InvalidRequest(
                        f"PutFrame.key: a new value started after {filled} of {total} bytes of the "
                        "previous one; send a value's frames consecutively (nothing of it was stored)"
                    )
                self._key(f.key, "PutFrame.key")
                if f.total_length == 0:
                    raise InvalidRequest("PutFrame.total_length: must be > 0 on a value's first frame")
                if f.total_length > self.settings.max_value_bytes:
                    raise LimitExceeded(
                        f"PutFrame.total_length: value of {f.total_length} bytes; this server accepts "
                        f"at most {self.settings.max_value_bytes} (--max-value-bytes)"
                    )
                if f.offset != 0:
                    raise InvalidRequest("PutFrame.offset: a value's first frame must have offset 0")
                key, total, filled = f.key, f.total_length, 0
                buf = None
                if n == total:
                    # Single-frame value: keep a read-only view into the message, no copy.
                    value: memoryview = f.data
                    filled = n
                else:
                    buf = self.store.receive_buffer(total)  # stored only once filled whole
            elif key is None:
                raise InvalidRequest("PutFrame.key: the first frame of a value must carry its key")
            else:
                if f.total_length not in (0, total):
                    raise InvalidRequest(
                        f"PutFrame.total_length: {f.total_length} changed inside a value of {total} bytes"
                    )
                if f.offset != filled:
                    raise InvalidRequest(f"PutFrame.offset: expected {filled}, got {f.offset}")
            if buf is not None:
                if filled + n > total:
                    raise InvalidRequest(
                        f"PutFrame.data: {filled + n} bytes exceed the value's total_length {total}"
                    )
                buf[filled : filled + n] = f.data
                filled += n
                value = memoryview(buf).toreadonly()
            if filled == total:
                self.metrics.received_bytes.inc(total)
                if await self.store.put(scoped(tenant, key), value):  # type: ignore[arg-type]
                    stored += 1
                else:
                    rejected += 1
                key, buf = None, None
        if key is not None:
            raise InvalidRequest(
                f"Put stream ended after {filled} of {total} bytes of a value; nothing of that "
                "value was stored"
            )
        return cache_pb2.PutResponse(stored=stored, rejected=rejected)

    # -- registration ------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler[object, object]:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Lookup": grpc.unary_unary_rpc_method_handler(
                    self._observed("Lookup", self.lookup, cache_pb2.LookupRequest),
                    request_deserializer=wire.identity,
                    response_serializer=cache_pb2.LookupResponse.SerializeToString,
                ),
                "Get": grpc.unary_stream_rpc_method_handler(
                    self._observed_stream("Get", self.get, cache_pb2.GetRequest),
                    request_deserializer=wire.identity,
                    response_serializer=wire.identity,
                ),
                "Put": grpc.stream_unary_rpc_method_handler(
                    self._observed("Put", self.put),
                    request_deserializer=wire.identity,
                    response_serializer=cache_pb2.PutResponse.SerializeToString,
                ),
                "Delete": grpc.unary_unary_rpc_method_handler(
                    self._observed("Delete", self.delete, cache_pb2.DeleteRequest),
                    request_deserializer=wire.identity,
                    response_serializer=cache_pb2.DeleteResponse.SerializeToString,
                ),
                "Stats": grpc.unary_unary_rpc_method_handler(
                    self._observed("Stats", self.stats, cache_pb2.StatsRequest),
                    request_deserializer=wire.identity,
                    response_serializer=cache_pb2.StatsResponse.SerializeToString,
                ),
            },
        )

    def _observed(
        self, op: str, fn: Callable[..., object], message: type[Message] | None = None
    ) -> Callable[..., object]:
        """Wraps a unary-response handler: request parsing, error mapping, metrics."""

        async def handle(request: object, context: grpc.aio.ServicerContext[object, object]) -> object:
            start = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                tenant = self.tenant_of(_metadata(context))
                if message is not None:
                    request = _parse(message, request)  # type: ignore[arg-type]
                return await fn(request, tenant)  # type: ignore[misc]
            except RequestError as exc:
                code = exc.code
                await context.abort(exc.code, str(exc))
            except Exception:
                if context.cancelled():
                    code = grpc.StatusCode.CANCELLED
                    raise
                code = grpc.StatusCode.INTERNAL
                logger.exception("%s failed", op)
                await context.abort(grpc.StatusCode.INTERNAL, f"{op}: internal error (see the server log)")
            finally:
                self.metrics.requests.labels(op, code.name).inc()
                self.metrics.latency.labels(op).observe(time.perf_counter() - start)
            raise AssertionError("unreachable")

        return handle

    def _observed_stream(
        self, op: str, fn: Callable[..., AsyncIterator[bytes]], message: type[Message]
    ) -> Callable[..., object]:
        """Wraps a streaming-response handler: request parsing, error mapping, metrics."""

        async def handle(
            request: bytes, context: grpc.aio.ServicerContext[object, object]
        ) -> AsyncIterator[bytes]:
            start = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                tenant = self.tenant_of(_metadata(context))
                async for frame in fn(_parse(message, request), tenant):
                    yield frame
            except RequestError as exc:
                code = exc.code
                await context.abort(exc.code, str(exc))
            except Exception:
                if context.cancelled():
                    code = grpc.StatusCode.CANCELLED
                    raise
                code = grpc.StatusCode.INTERNAL
                logger.exception("%s failed", op)
                await context.abort(grpc.StatusCode.INTERNAL, f"{op}: internal error (see the server log)")
            finally:
                self.metrics.requests.labels(op, code.name).inc()
                self.metrics.latency.labels(op).observe(time.perf_counter() - start)

        return handle


def _parse(message: type[Message], raw: bytes) -> Message:
    try:
        return message.FromString(raw)
    except DecodeError as exc:
        raise InvalidRequest(f"{message.__name__}: not a valid protobuf message ({exc})") from None


def _metadata(context: grpc.aio.ServicerContext[object, object]) -> Metadata | None:
    md = context.invocation_metadata()
    return None if md is None else [(k, v) for k, v in md]
