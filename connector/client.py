"""A synchronous, thread-safe client of the kvtier cache tier (kvtier.v1.CacheService).

Used inside vLLM (scheduler and worker threads) and by tools and benchmarks.
Every call has a deadline (``timeout_s`` per call, or the client's default).
Values move as raw frames (``kvtier.proto.wire``): a value is sent as frames
of at most ``frame_bytes`` without protobuf copies, and a received single-frame
value is handed out as a view into the received message.

Errors: any transport failure or deadline raises ``TierUnavailable``; a call
the server refuses (bad key, limit) raises ``TierRejected`` with the server's
message. Nothing else escapes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import grpc
from typing_extensions import Buffer

from kvtier.connector.errors import TierRejected, TierUnavailable
from kvtier.proto import SERVICE_NAME, cache_pb2, wire

DEFAULT_FRAME_BYTES = 4 << 20
_UNAVAILABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
}

Value = Buffer | Sequence[Buffer]


class TierClient:
    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = 5.0,
        token: str | None = None,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        max_receive_bytes: int = 64 << 20,
        tls: bool = False,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
    ) -> None:
        """``token``: bearer token of the caller's tenant. TLS is on when ``tls`` is set or
        any ``tls_*`` file is given (``tls_ca_file``: the CA that signed the tier's
        certificate, else the system roots; ``tls_cert_file``/``tls_key_file``: a client
        certificate for mutual TLS)."""
        self.target = target
        self.timeout_s = timeout_s
        self.frame_bytes = frame_bytes
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        options = [
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.max_send_message_length", frame_bytes + (1 << 20)),
            ("grpc.enable_retries", 0),
        ]
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

    def __enter__(self) -> TierClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _timeout(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s

    # -- calls ----------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """How many leading keys the tier holds (one round trip)."""
        if not keys:
            return 0
        with _errors("Lookup"):
            response = self._lookup(
                cache_pb2.LookupRequest(keys=keys), timeout=self._timeout(timeout_s), metadata=self._metadata
            )
        return int(response.prefix_length)

    def get(
        self,
        keys: Sequence[bytes],
        *,
        stop_at_first_miss: bool = True,
        timeout_s: float | None = None,
    ) -> list[bytes | memoryview | None]:
        """The values of ``keys`` in order (None for a miss). With ``stop_at_first_miss``
        the list ends at the first miss (it is shorter than ``keys``)."""
        out: list[bytes | memoryview | None] = []
        if not keys:
            return out
        request = cache_pb2.GetRequest(keys=keys, stop_at_first_miss=stop_at_first_miss)
        buf: bytearray | None = None
        with _errors("Get"):
            for raw in self._get(request, timeout=self._timeout(timeout_s), metadata=self._metadata):
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
                    buf = bytearray(frame.total_length)
                if buf is None or frame.offset + n > len(buf):
                    raise TierRejected("Get: malformed frame sequence from the tier")
                buf[frame.offset : frame.offset + n] = frame.data
                if frame.offset + n == frame.total_length:
                    out.append(memoryview(buf).toreadonly())
                    buf = None
        return out

    def put(self, items: Iterable[tuple[bytes, Value]], *, timeout_s: float | None = None) -> int:
        """Stores values; returns how many the tier stored. A value may be given as
        several buffers (e.g. a codec header and the payload): they are sent as one."""
        with _errors("Put"):
            response = self._put(
                self._frames(items), timeout=self._timeout(timeout_s), metadata=self._metadata
            )
        return int(response.stored)

    def delete(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        with _errors("Delete"):
            response = self._delete(
                cache_pb2.DeleteRequest(keys=keys), timeout=self._timeout(timeout_s), metadata=self._metadata
            )
        return int(response.deleted)

    def stats(self, *, timeout_s: float | None = None) -> cache_pb2.StatsResponse:
        with _errors("Stats"):
            response: cache_pb2.StatsResponse = self._stats(
                cache_pb2.StatsRequest(), timeout=self._timeout(timeout_s), metadata=self._metadata
            )
        return response

    # -- framing --------------------------------------------------------------------

    def _frames(self, items: Iterable[tuple[bytes, Value]]) -> Iterator[bytes]:
        limit = self.frame_bytes - wire.FRAME_OVERHEAD
        for key, value in items:
            pieces: Sequence[Buffer] = value if isinstance(value, list | tuple) else [value]  # type: ignore[list-item]
            parts = [memoryview(p).cast("B") for p in pieces]
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
                        yield self._frame(key if first else b"", total, offset, pending)
                        first = False
                        offset += pending_n
                        pending, pending_n = [], 0
            if pending_n or first:
                yield self._frame(key if first else b"", total, offset, pending)

    @staticmethod
    def _frame(key: bytes, total: int, offset: int, pieces: list[memoryview]) -> bytes:
        return wire.encode_put_frame(key, total if key else 0, offset, *pieces)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


class _errors:
    """Maps grpc.RpcError to TierUnavailable / TierRejected."""

    def __init__(self, op: str) -> None:
        self.op = op

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
            code = exc.code()
            message = f"{self.op}: {code.name}: {exc.details()}"
            if code in _UNAVAILABLE:
                raise TierUnavailable(message) from exc
            raise TierRejected(message) from exc
        if isinstance(exc, grpc.RpcError):
            raise TierUnavailable(f"{self.op}: {exc}") from exc
