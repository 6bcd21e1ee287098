"""The gRPC edge: kvtier.v1.CacheService calls decoded into ``RequestCore`` calls.

It only translates: protobuf requests (strict: unknown fields are refused) and
``Put`` frames (``kvtier.proto.wire``, reassembled in order) in, protobuf
responses and ``Get`` frames out, and the core's ``RequestError`` classes to
gRPC status codes (``STATUS_CODES``, the one place that does). Validation,
tenants, limits and the store are the core's (``kvtier.cacheserver.core``).
``Get`` and ``Put`` move values as raw frames, without protobuf copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from kvtier.cacheserver.budget import Reservation
from kvtier.cacheserver.core import RequestCore, StatsView, Value
from kvtier.cacheserver.errors import (
    InvalidRequest,
    LimitExceeded,
    Overloaded,
    RequestError,
    Stalled,
    Unauthenticated,
)
from kvtier.proto import SERVICE_NAME, cache_pb2, wire

logger = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, str | bytes]]

# Put frames may be up to this large (a client chooses its frame size).
MAX_PUT_FRAME_BYTES = 16 << 20

STATUS_CODES: dict[type[RequestError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    LimitExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Overloaded: grpc.StatusCode.UNAVAILABLE,
    Stalled: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_code(error: RequestError) -> grpc.StatusCode:
    """The gRPC status a refused request is answered with."""
    for cls in type(error).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INVALID_ARGUMENT


class CacheServicer:
    def __init__(self, core: RequestCore) -> None:
        self.core = core

    # -- unary calls ------------------------------------------------------------------

    async def lookup(self, request: cache_pb2.LookupRequest, tenant: str) -> cache_pb2.LookupResponse:
        _no_unknown_fields(request)
        keys = list(request.keys)
        self.core.check_keys("LookupRequest.keys", keys)
        return cache_pb2.LookupResponse(prefix_length=await self.core.lookup(tenant, keys))

    async def delete(self, request: cache_pb2.DeleteRequest, tenant: str) -> cache_pb2.DeleteResponse:
        _no_unknown_fields(request)
        keys = list(request.keys)
        self.core.check_keys("DeleteRequest.keys", keys)
        return cache_pb2.DeleteResponse(deleted=await self.core.delete(tenant, keys))

    async def stats(self, request: cache_pb2.StatsRequest, tenant: str) -> cache_pb2.StatsResponse:
        _no_unknown_fields(request)
        return _stats_response(self.core.stats(tenant))

    # -- streams (raw frames) -------------------------------------------------------

    async def get(self, request: cache_pb2.GetRequest, tenant: str) -> AsyncIterator[bytes]:
        _no_unknown_fields(request)
        keys = list(request.keys)
        self.core.check_keys("GetRequest.keys", keys)
        frame = self.core.settings.frame_bytes - wire.FRAME_OVERHEAD
        values = self.core.get(tenant, keys, request.stop_at_first_miss)
        async with contextlib.aclosing(values):
            async for index, value in values:
                if value is None:
                    yield wire.encode_get_frame(index, False, 0, 0, b"")
                    continue
                view = memoryview(value)
                total = view.nbytes
                for offset in range(0, total, frame):
                    yield wire.encode_get_frame(index, True, total, offset, view[offset : offset + frame])

    async def put(self, request_iterator: AsyncIterator[bytes], tenant: str) -> cache_pb2.PutResponse:
        stored = rejected = 0
        key: bytes | None = None
        buf: bytearray | memoryview | None = None
        held: Reservation | None = None  # the budget held by the value being received
        value: Value = b""
        total = filled = 0
        frames = _frames(request_iterator, self.core.settings.data_timeout_s)
        try:
            async for raw in frames:
                try:
                    f = wire.decode_put_frame(raw)
                except wire.WireError as exc:
                    raise InvalidRequest(str(exc)) from None
                n = f.data.nbytes
                if f.key:
                    if key is not None:
                        raise InvalidRequest(
                            f"PutFrame.key: a new value started after {filled} of {total} bytes of "
                            "the previous one; send a value's frames consecutively (nothing of it "
                            "was stored)"
                        )
                    self.core.check_key("PutFrame.key", f.key)
                    self.core.check_value_length("PutFrame.total_length", f.total_length)
                    if f.offset != 0:
                        raise InvalidRequest("PutFrame.offset: a value's first frame must have offset 0")
                    key, total, filled = f.key, f.total_length, 0
                    buf = None
                    if n == total:
                        # Single-frame value: keep a read-only view into the message, no copy.
                        value = f.data
                        filled = n
                    else:
                        held = self.core.reserve("PutFrame.total_length", total)
                        buf = self.core.receive_buffer(total, tenant)  # stored only once filled whole
                elif key is None:
                    raise InvalidRequest("PutFrame.key: the first frame of a value must carry its key")
                else:
                    if f.total_length not in (0, total):
                        raise InvalidRequest(
                            f"PutFrame.total_length: {f.total_length} changed inside a value of "
                            f"{total} bytes"
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
                    if await self.core.store_value(tenant, key, value):
                        stored += 1
                    else:
                        rejected += 1
                    key, buf, value = None, None, b""
                    if held is not None:
                        held.release()
                        held = None
        finally:
            if held is not None:
                held.release()
            await frames.aclose()
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
                tenant = self.core.tenant(_authorization(context))
                if message is not None:
                    request = _parse(message, request)  # type: ignore[arg-type]
                return await fn(request, tenant)  # type: ignore[misc]
            except RequestError as exc:
                code = status_code(exc)
                await context.abort(code, str(exc))
            except Exception:
                if context.cancelled():
                    code = grpc.StatusCode.CANCELLED
                    raise
                code = grpc.StatusCode.INTERNAL
                logger.exception("%s failed", op)
                await context.abort(grpc.StatusCode.INTERNAL, f"{op}: internal error (see the server log)")
            finally:
                self.core.answered(op, code.name, start)
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
                tenant = self.core.tenant(_authorization(context))
                async for frame in fn(_parse(message, request), tenant):
                    yield frame
            except RequestError as exc:
                code = status_code(exc)
                await context.abort(code, str(exc))
            except Exception:
                if context.cancelled():
                    code = grpc.StatusCode.CANCELLED
                    raise
                code = grpc.StatusCode.INTERNAL
                logger.exception("%s failed", op)
                await context.abort(grpc.StatusCode.INTERNAL, f"{op}: internal error (see the server log)")
            finally:
                self.core.answered(op, code.name, start)

        return handle


async def _frames(stream: AsyncIterator[bytes], timeout_s: float) -> AsyncGenerator[bytes, None]:
    """The frames of a Put stream; raises Stalled when none comes for ``timeout_s``."""
    frames = aiter(stream)
    while True:
        try:
            async with asyncio.timeout(timeout_s):
                frame = await anext(frames)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise Stalled(
                f"Put: no frame for {timeout_s:g}s (--data-timeout); the stream is closed and "
                "nothing of a value in progress was stored"
            ) from None
        yield frame


def _no_unknown_fields(message: Message) -> None:
    unknown = UnknownFieldSet(message)
    if len(unknown):
        numbers = sorted({unknown[i].field_number for i in range(len(unknown))})
        raise InvalidRequest(
            f"{type(message).__name__} has fields this server does not know (numbers {numbers}): "
            "the client speaks a newer kvtier.v1 contract; upgrade the server"
        )


def _parse(message: type[Message], raw: bytes) -> Message:
    try:
        return message.FromString(raw)
    except DecodeError as exc:
        raise InvalidRequest(f"{message.__name__}: not a valid protobuf message ({exc})") from None


def _authorization(context: grpc.aio.ServicerContext[object, object]) -> str | None:
    """The call's ``authorization`` metadata value (None when absent)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value.decode() if isinstance(value, bytes) else value
    return None


def _stats_response(view: StatsView) -> cache_pb2.StatsResponse:
    return cache_pb2.StatsResponse(
        tiers=[
            cache_pb2.TierStats(
                name=t.name,
                healthy=t.healthy,
                used_bytes=t.used_bytes,
                capacity_bytes=t.capacity_bytes,
                entries=t.entries,
                hits=t.hits,
                misses=t.misses,
                evictions=t.evictions,
            )
            for t in view.tiers
        ],
        max_value_bytes=view.max_value_bytes,
        frame_bytes=view.frame_bytes,
        max_keys_per_request=view.max_keys,
        tenant=view.tenant,
        data_port=view.data_port,
    )
