"""``GrpcTransport``: every call of the tier client over the tier's gRPC port.

Values move as raw frames (``kvtier.proto.wire``): a value is sent as frames of at
most ``frame_bytes`` without protobuf copies, and a received single-frame value is
handed out as a view into the received message; a value of several frames is
assembled in a buffer from the client's ``ReceiveBuffers``.

Reconnects: gRPC's default reconnect backoff (1 s growing to 120 s) would keep a
channel failing fast for minutes after a restarted tier is back on its address; the
channel reconnects after 100 ms to 1 s instead (``RECONNECT_OPTIONS``; the
connector's circuit breaker already limits how often a dead tier is called).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc
from typing_extensions import Buffer

from kvtier.connector.client.codes import tier_error
from kvtier.connector.client.transport import Items, Values
from kvtier.connector.errors import TierRejected, TierUnavailable
from kvtier.proto import SERVICE_NAME, cache_pb2, wire
from kvtier.proto.buffers import ReceiveBuffers

Metadata = tuple[tuple[str, str], ...] | None

RECONNECT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
"""Channel options for a quick reconnect to a tier that restarted (see the module doc)."""


class GrpcTransport:
    name = "grpc"

    def __init__(
        self,
        target: str,
        *,
        frame_bytes: int,
        max_receive_bytes: int,
        buffers: ReceiveBuffers,
        metadata: Metadata,
        tls: bool = False,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        """``metadata``: sent with every call (the bearer token); the client replaces it
        when the token changes. TLS is on when ``tls`` is set or any ``tls_*`` file is
        given. ``channel_options`` apply after (so override) the transport's own."""
        self.frame_bytes = frame_bytes
        self.metadata = metadata
        self._buffers = buffers
        options = [
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.max_send_message_length", frame_bytes + (1 << 20)),
            ("grpc.enable_retries", 0),
            *RECONNECT_OPTIONS,
        ]
        overridden = {name for name, _ in channel_options}
        options = [o for o in options if o[0] not in overridden] + list(channel_options)
        if tls or tls_ca_file or tls_cert_file or tls_key_file:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca_file),
                private_key=_read(tls_key_file),
                certificate_chain=_read(tls_cert_file),
            )
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        path = f"/{SERVICE_NAME}/"
        self._lookup = self._channel.unary_unary(
            path + "Lookup",
            request_serializer=cache_pb2.LookupRequest.SerializeToString,
            response_deserializer=cache_pb2.LookupResponse.FromString,
        )
        self._get = self._channel.unary_stream(
            path + "Get",
            request_serializer=cache_pb2.GetRequest.SerializeToString,
            response_deserializer=wire.identity,
        )
        self._put = self._channel.stream_unary(
            path + "Put",
            request_serializer=wire.identity,
            response_deserializer=cache_pb2.PutResponse.FromString,
        )
        self._delete = self._channel.unary_unary(
            path + "Delete",
            request_serializer=cache_pb2.DeleteRequest.SerializeToString,
            response_deserializer=cache_pb2.DeleteResponse.FromString,
        )
        self._stats = self._channel.unary_unary(
            path + "Stats",
            request_serializer=cache_pb2.StatsRequest.SerializeToString,
            response_deserializer=cache_pb2.StatsResponse.FromString,
        )

    def close(self) -> None:
        self._channel.close()

    # -- calls ----------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], *, timeout_s: float) -> int:
        with _errors("Lookup"):
            response = self._lookup(
                cache_pb2.LookupRequest(keys=keys), timeout=timeout_s, metadata=self.metadata
            )
        return int(response.prefix_length)

    def get(self, keys: Sequence[bytes], *, stop_at_first_miss: bool, timeout_s: float) -> Values:
        out: Values = []
        request = cache_pb2.GetRequest(keys=keys, stop_at_first_miss=stop_at_first_miss)
        buf: bytearray | None = None
        with _errors("Get"):
            for raw in self._get(request, timeout=timeout_s, metadata=self.metadata):
                frame = wire.decode_get_frame(raw)
                if frame.index != len(out):
                    raise TierRejected(f"Get: frame for key {frame.index} arrived out of order")
                if not frame.found:
                    out.append(None)
                    continue
                n = frame.data.nbytes
                if frame.offset == 0 and n == frame.total_length:
                    out.append(frame.data)
                    continue
                if frame.offset == 0:
                    buf = self._buffers.take(frame.total_length)
                if buf is None or frame.offset + n > len(buf):
                    raise TierRejected("Get: malformed frame sequence from the tier")
                buf[frame.offset : frame.offset + n] = frame.data
                if frame.offset + n == frame.total_length:
                    out.append(memoryview(buf).toreadonly())
                    buf = None
        return out

    def put(self, items: Items, *, timeout_s: float) -> int:
        with _errors("Put"):
            response = self._put(self._frames(items), timeout=timeout_s, metadata=self.metadata)
        return int(response.stored)

    def delete(self, keys: Sequence[bytes], *, timeout_s: float) -> int:
        with _errors("Delete"):
            response = self._delete(
                cache_pb2.DeleteRequest(keys=keys), timeout=timeout_s, metadata=self.metadata
            )
        return int(response.deleted)

    def stats(self, *, timeout_s: float) -> cache_pb2.StatsResponse:
        with _errors("Stats"):
            response: cache_pb2.StatsResponse = self._stats(
                cache_pb2.StatsRequest(), timeout=timeout_s, metadata=self.metadata
            )
        return response

    # -- framing --------------------------------------------------------------------

    def _frames(self, items: Iterable[tuple[bytes, Sequence[Buffer]]]) -> Iterator[bytes]:
        limit = self.frame_bytes - wire.FRAME_OVERHEAD
        for key, value in items:
            parts = [memoryview(p).cast("B") for p in value]
            total = sum(p.nbytes for p in parts)
            offset = 0
            first = True
            pending: list[memoryview] = []
            pending_n = 0
            for part in parts:
                while part.nbytes:
                    take = min(part.nbytes, limit - pending_n)
                    pending.append(part[:take])
                    pending_n += take
                    part = part[take:]
                    if pending_n == limit:
                        yield _frame(key if first else b"", total, offset, pending)
                        first = False
                        offset += pending_n
                        pending, pending_n = [], 0
            if pending_n or first:
                yield _frame(key if first else b"", total, offset, pending)


def _frame(key: bytes, total: int, offset: int, pieces: list[memoryview]) -> bytes:
    return wire.encode_put_frame(key, total if key else 0, offset, *pieces)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


class _errors:
    """Maps grpc.RpcError to TierUnavailable / TierRejected (``codes``)."""

    def __init__(self, op: str) -> None:
        self.op = op

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
            raise tier_error(self.op, exc.code().name, str(exc.details())) from exc
        if isinstance(exc, grpc.RpcError):
            raise TierUnavailable(f"{self.op}: {exc}") from exc
