"""A synchronous, thread-safe client of the kvtier cache tier (kvtier.v1.CacheService).

Used inside vLLM (scheduler and worker threads) and by tools and benchmarks.
Every call has a deadline (``timeout_s`` per call, or the client's default).
Values move as raw frames (``kvtier.proto.wire``): a value is sent as frames
of at most ``frame_bytes`` without protobuf copies, and a received single-frame
value is handed out as a view into the received message.

Get and Put move values over the tier's data port (raw bytes, no frames:
``kvtier.connector.dataport``) when the tier advertises one in ``Stats``
(``data_path="auto"``, the default): on the gRPC target's host, with the same
token and TLS files. When the data port cannot be reached the client logs it
once and uses gRPC, and tries the data port again after ``DATA_RETRY_S``.
Lookup, Delete and Stats always use gRPC.

Errors: any transport failure or deadline raises ``TierUnavailable``; a call
the server refuses (bad key, limit) raises ``TierRejected`` with the server's
message. Nothing else escapes. Both paths raise the same errors for the same
causes.

Reconnects: gRPC's default reconnect backoff (1 s growing to 120 s) would keep a
channel failing fast for minutes after a restarted tier is back on its address;
the client reconnects after 100 ms to 1 s instead (``RECONNECT_OPTIONS``; the
connector's circuit breaker already limits how often a dead tier is called).

Receive buffers: a caller done with the values of a ``get`` can hand them back with
``recycle``; later Gets receive values of the same size (1 MiB and larger) into those
buffers instead of fresh memory (``kvtier.proto.buffers``). The connector's worker does
so once a request's chunks are copied into vLLM's KV cache.

Token rotation: with ``token_file`` the token is read from that file, and read again
when the tier answers UNAUTHENTICATED; a changed token is used from the next call on
(the failed call is not retried).
"""

from __future__ import annotations

import functools
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, MutableSequence, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc
from typing_extensions import Buffer

from kvtier.connector.config import read_token_file
from kvtier.connector.dataport import DataConnectError, DataPool
from kvtier.connector.errors import ConfigError, TierError, TierRejected, TierUnavailable
from kvtier.proto import SERVICE_NAME, cache_pb2, wire
from kvtier.proto.buffers import ReceiveBuffers

logger = logging.getLogger(__name__)

DEFAULT_FRAME_BYTES = 4 << 20
DEFAULT_RECEIVE_BUFFER_BYTES = 256 << 20
_UNAVAILABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
}

Value = Buffer | Sequence[Buffer]
DATA_PATHS = ("auto", "grpc", "data")
# After the data port could not be used (or the tier advertised none), "auto"
# stays on gRPC this long before it asks again.
DATA_RETRY_S = 60.0
RECONNECT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
"""Channel options for a quick reconnect to a tier that restarted (see the module doc)."""


P = ParamSpec("P")
R = TypeVar("R")


def _reauth(
    method: Callable[Concatenate[TierClient, P], R],
) -> Callable[Concatenate[TierClient, P], R]:
    """Reads ``token_file`` again when the call was refused as UNAUTHENTICATED."""

    @functools.wraps(method)
    def call(self: TierClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except TierRejected as exc:
            if exc.code == "UNAUTHENTICATED":
                self._reload_token()
            raise

    return call


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
        data_path: str = "auto",
        token_file: str | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        receive_buffer_bytes: int = DEFAULT_RECEIVE_BUFFER_BYTES,
    ) -> None:
        """``token``: bearer token of the caller's tenant. TLS is on when ``tls`` is set or
        any ``tls_*`` file is given (``tls_ca_file``: the CA that signed the tier's
        certificate, else the system roots; ``tls_cert_file``/``tls_key_file``: a client
        certificate for mutual TLS). ``data_path``: "auto" (Get/Put over the tier's data
        port when it advertises one, else gRPC), "grpc" (never the data port) or "data"
        (always the data port: a tier without one is ``TierUnavailable``). ``token_file``:
        read the token from this file (unless ``token`` is given), and again whenever the
        tier answers UNAUTHENTICATED. ``channel_options``: extra gRPC channel options,
        applied after (so overriding) the client's own. ``receive_buffer_bytes``: at most
        this many bytes of buffers given back with ``recycle`` are kept to receive later
        Get values into (0: none)."""
        if data_path not in DATA_PATHS:
            raise ConfigError(f"data_path={data_path!r}: expected one of {', '.join(DATA_PATHS)}")
        self.target = target
        self.timeout_s = timeout_s
        self.frame_bytes = frame_bytes
        self.data_path = data_path
        self._token_file = token_file
        if token is None and token_file is not None:
            token = read_token_file(token_file)
        self._token = token
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._data_host = _host(target)
        self._data: DataPool | None = None
        self._buffers = ReceiveBuffers(receive_buffer_bytes)
        self._data_lock = threading.RLock()  # _data_pool -> stats -> _reload_token
        self._data_retry_at = 0.0
        self._data_warned = False
        self._ssl: ssl.SSLContext | None = None
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
            self._ssl = ssl.create_default_context(cafile=tls_ca_file)
            if tls_cert_file:
                self._ssl.load_cert_chain(tls_cert_file, tls_key_file)
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
        with self._data_lock:
            data, self._data = self._data, None
        if data is not None:
            data.close()
        self._channel.close()

    def _reload_token(self) -> None:
        """Take a rotated token from ``token_file`` (a no-op without one, or unchanged)."""
        if self._token_file is None:
            return
        try:
            token = read_token_file(self._token_file)
        except ConfigError as exc:
            logger.warning("kvtier: the tier refused the token and %s", exc)
            return
        if token == self._token:
            return
        logger.info("kvtier: the tier token in %s changed; using the new one", self._token_file)
        self._token = token
        self._metadata = (("authorization", f"Bearer {token}"),)
        with self._data_lock:  # data-port connections authenticate once, at connect
            data, self._data = self._data, None
            self._data_retry_at = 0.0
        if data is not None:
            data.close()

    def _timeout(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s

    # -- calls ----------------------------------------------------------------------

    @_reauth
    def lookup(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """How many leading keys the tier holds (one round trip)."""
        if not keys:
            return 0
        with _errors("Lookup"):
            response = self._lookup(
                cache_pb2.LookupRequest(keys=keys),
                timeout=self._timeout(timeout_s),
                metadata=self._metadata,
            )
        return int(response.prefix_length)

    @_reauth
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
        data = self._data_pool(timeout_s)
        if data is not None:
            try:
                return data.get(
                    keys, stop_at_first_miss=stop_at_first_miss, timeout_s=self._timeout(timeout_s)
                )
            except DataConnectError as exc:
                self._data_failed(exc)
        request = cache_pb2.GetRequest(keys=keys, stop_at_first_miss=stop_at_first_miss)
        buf: bytearray | None = None
        with _errors("Get"):
            for raw in self._get(
                request, timeout=self._timeout(timeout_s), metadata=self._metadata
            ):
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

    def recycle(self, values: MutableSequence[bytes | memoryview | None]) -> int:
        """Gives back the buffers of ``get`` values the caller is done with (``values``
        is emptied): later Gets receive values of the same size into them instead of
        fresh memory, which costs page faults and zeroing for large values (~80 ms for
        64 MiB here). A buffer anything still references (a view, a tensor made from
        it) is left alone; at most ``receive_buffer_bytes`` are kept. Returns how many
        buffers were kept."""
        return self._buffers.give_back(values)

    @_reauth
    def put(self, items: Iterable[tuple[bytes, Value]], *, timeout_s: float | None = None) -> int:
        """Stores values; returns how many the tier stored. A value may be given as
        several buffers (e.g. a codec header and the payload): they are sent as one."""
        data = self._data_pool(timeout_s)
        if data is not None:
            listed = [(key, _pieces(value)) for key, value in items]
            items = listed
            try:
                return data.put(listed, timeout_s=self._timeout(timeout_s))
            except DataConnectError as exc:
                self._data_failed(exc)
        with _errors("Put"):
            response = self._put(
                self._frames(items), timeout=self._timeout(timeout_s), metadata=self._metadata
            )
        return int(response.stored)

    @_reauth
    def delete(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        with _errors("Delete"):
            response = self._delete(
                cache_pb2.DeleteRequest(keys=keys),
                timeout=self._timeout(timeout_s),
                metadata=self._metadata,
            )
        return int(response.deleted)

    @_reauth
    def stats(self, *, timeout_s: float | None = None) -> cache_pb2.StatsResponse:
        with _errors("Stats"):
            response: cache_pb2.StatsResponse = self._stats(
                cache_pb2.StatsRequest(), timeout=self._timeout(timeout_s), metadata=self._metadata
            )
        return response

    # -- the data port --------------------------------------------------------------

    def _data_pool(self, timeout_s: float | None) -> DataPool | None:
        """The data-port pool to use for this call, or None for gRPC (asks Stats once)."""
        if self.data_path == "grpc" or self._data is not None:
            return self._data
        if self.data_path == "auto" and (
            self._data_host is None or time.monotonic() < self._data_retry_at
        ):
            return None
        with self._data_lock:
            if self._data is not None:
                return self._data
            if self.data_path == "auto" and time.monotonic() < self._data_retry_at:
                return None
            try:
                port = self.stats(timeout_s=timeout_s).data_port
            except TierError:
                if self.data_path == "data":
                    raise
                self._data_retry_at = time.monotonic() + DATA_RETRY_S
                return None
            if not port or self._data_host is None:
                if self.data_path == "data":
                    raise TierUnavailable(
                        f"the tier at {self.target} has no data port reachable from here "
                        "(start it with --data-port, or use data_path='auto')"
                    )
                self._data_retry_at = time.monotonic() + DATA_RETRY_S
                return None
            authorization = None if self._metadata is None else self._metadata[0][1]
            self._data = DataPool(
                self._data_host,
                port,
                authorization=authorization,
                context=self._ssl,
                buffers=self._buffers,
            )
            return self._data

    def _data_failed(self, exc: DataConnectError) -> None:
        if self.data_path == "data":
            raise TierUnavailable(f"UNAVAILABLE: {exc}") from exc
        with self._data_lock:
            data, self._data = self._data, None
            self._data_retry_at = time.monotonic() + DATA_RETRY_S
            warned, self._data_warned = self._data_warned, True
        if data is not None:
            data.close()
        log = logger.debug if warned else logger.warning
        log(
            "kvtier: %s; moving values over gRPC, trying the data port again in %.0fs",
            exc,
            DATA_RETRY_S,
        )

    # -- framing --------------------------------------------------------------------

    def _frames(self, items: Iterable[tuple[bytes, Value]]) -> Iterator[bytes]:
        limit = self.frame_bytes - wire.FRAME_OVERHEAD
        for key, value in items:
            parts = [memoryview(p).cast("B") for p in _pieces(value)]
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


def _pieces(value: Value) -> Sequence[Buffer]:
    return value if isinstance(value, list | tuple) else [value]  # type: ignore[list-item]


def _host(target: str) -> str | None:
    """The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port"); None for unix: targets."""
    t = target.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    if t.startswith("unix:") or not t:
        return None
    if t.startswith("["):
        return t[1 : t.index("]")] if "]" in t else None
    host = t.rsplit(":", 1)[0] if t.count(":") == 1 else t
    return host or None


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
            raise TierRejected(message, code.name) from exc
        if isinstance(exc, grpc.RpcError):
            raise TierUnavailable(f"{self.op}: {exc}") from exc
