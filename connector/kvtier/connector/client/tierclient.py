"""A synchronous, thread-safe client of the kvtier cache tier (kvtier.v1.CacheService).

Used inside vLLM (scheduler and worker threads) and by tools and benchmarks.
Every call has a deadline (``timeout_s`` per call, or the client's default); it covers
the whole call, the pick of a transport included.

Transports: every call goes through one ``Transport`` (``kvtier.connector.client.transport``),
picked once per connection: the same-node transport when ``local_socket`` names the
tier's Unix socket and something answers there (every call over the socket, values
through shared memory: ``local.LocalTransport``); else, when the tier advertises a data
port in ``Stats`` and ``data_path`` allows it, the data port for Get and Put (raw
bytes, no frames: ``dataport.DataPortTransport``) with Lookup, Delete and Stats over
gRPC; else gRPC (``grpc.GrpcTransport``). The data port is reached on the gRPC target's
host, with the same token and TLS files. ``transport.py`` has the pick order, when the
client picks again, and where another transport goes. When the socket or the data
port cannot be reached the client logs it once, uses the next transport, and tries
again after ``DATA_RETRY_S``.

Errors: any transport failure or deadline raises ``TierUnavailable``; a call
the server refuses (bad key, limit) raises ``TierRejected`` with the server's
message. Nothing else escapes. Both transports raise the same errors for the same
causes (one table of codes: ``kvtier.connector.client.codes``).

Receive buffers: a caller done with the values of a ``get`` can hand them back with
``recycle``; later Gets receive values of the same size (1 MiB and larger) into those
buffers instead of fresh memory (``kvtier.proto.buffers``). The connector's worker does
so once a request's chunks are copied into vLLM's KV cache.

Token rotation: with ``token_file`` the token is read from that file, and read again
when the tier answers UNAUTHENTICATED; a changed token is used from the next call on
(the failed call is not retried).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, MutableSequence, Sequence
from typing import Any, TypeVar

from typing_extensions import Buffer

from kvtier.connector.client.dataport import DataPortTransport, tls_context
from kvtier.connector.client.grpc import GrpcTransport
from kvtier.connector.client.local import LocalTransport
from kvtier.connector.client.transport import Transport, TransportUnreachable, Values
from kvtier.connector.config import read_token_file
from kvtier.connector.errors import ConfigError, TierRejected, TierUnavailable
from kvtier.proto import cache_pb2
from kvtier.proto.buffers import ReceiveBuffers

logger = logging.getLogger(__name__)

DEFAULT_FRAME_BYTES = 4 << 20
DEFAULT_RECEIVE_BUFFER_BYTES = 256 << 20

Value = Buffer | Sequence[Buffer]
DATA_PATHS = ("auto", "grpc", "data", "local")
# After the local socket or the data port could not be used (or the tier advertised
# no data port), "auto" stays on the next transport this long before it tries again.
DATA_RETRY_S = 60.0

R = TypeVar("R")


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
        local_socket: str | None = None,
    ) -> None:
        """``token``: bearer token of the caller's tenant. TLS is on when ``tls`` is set or
        any ``tls_*`` file is given (``tls_ca_file``: the CA that signed the tier's
        certificate, else the system roots; ``tls_cert_file``/``tls_key_file``: a client
        certificate for mutual TLS). ``local_socket``: the Unix socket of a tier on this
        node (``kvtier server --local-socket``), tried first. ``data_path``: "auto" (the
        local socket when given and answering, else Get/Put over the tier's data port when
        it advertises one, else gRPC), "grpc" (neither), "data" (always the data port: a
        tier without one is ``TierUnavailable``) or "local" (always the local socket, which
        must be given). ``token_file``:
        read the token from this file (unless ``token`` is given), and again whenever the
        tier answers UNAUTHENTICATED. ``channel_options``: extra gRPC channel options,
        applied after (so overriding) the client's own. ``receive_buffer_bytes``: at most
        this many bytes of buffers given back with ``recycle`` are kept to receive later
        Get values into (0: none)."""
        if data_path not in DATA_PATHS:
            raise ConfigError(f"data_path={data_path!r}: expected one of {', '.join(DATA_PATHS)}")
        if data_path == "local" and not local_socket:
            raise ConfigError("data_path='local' needs local_socket (the tier's Unix socket)")
        self.local_socket = local_socket
        self.target = target
        self.timeout_s = timeout_s
        self.frame_bytes = frame_bytes
        self.data_path = data_path
        self._token_file = token_file
        if token is None and token_file is not None:
            token = read_token_file(token_file)
        self._token = token
        self._data_host = _host(target)
        self._buffers = ReceiveBuffers(receive_buffer_bytes)
        secure = bool(tls or tls_ca_file or tls_cert_file or tls_key_file)
        self._ssl = tls_context(tls_ca_file, tls_cert_file, tls_key_file) if secure else None
        self._grpc = GrpcTransport(
            target,
            frame_bytes=frame_bytes,
            max_receive_bytes=max_receive_bytes,
            buffers=self._buffers,
            metadata=_metadata(token),
            tls=tls,
            tls_ca_file=tls_ca_file,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            channel_options=channel_options,
        )
        # The transport of this connection, and until when it stands (monotonic time):
        # None until the first call, and again after a failure or a token change.
        self._choice: tuple[Transport, float] | None = None
        self._grpc_until = 0.0  # "auto": gRPC without asking Stats until then
        self._local_until = 0.0  # "auto": no local socket tried until then
        self._warned = False
        self._local_warned = False
        self._lock = threading.Lock()

    def __enter__(self) -> TierClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            choice, self._choice = self._choice, None
        if choice is not None and choice[0] is not self._grpc:
            choice[0].close()
        self._grpc.close()

    @property
    def transport(self) -> str:
        """The name of the transport picked for this connection ("" before the first call)."""
        choice = self._choice
        return choice[0].name if choice is not None else ""

    # -- calls ----------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """How many leading keys the tier holds (one round trip)."""
        if not keys:
            return 0
        return self._call(lambda t, left: t.lookup(keys, timeout_s=left), timeout_s)

    def get(
        self,
        keys: Sequence[bytes],
        *,
        stop_at_first_miss: bool = True,
        timeout_s: float | None = None,
    ) -> Values:
        """The values of ``keys`` in order (None for a miss). With ``stop_at_first_miss``
        the list ends at the first miss (it is shorter than ``keys``)."""
        if not keys:
            return []
        return self._call(
            lambda t, left: t.get(keys, stop_at_first_miss=stop_at_first_miss, timeout_s=left),
            timeout_s,
        )

    def recycle(self, values: MutableSequence[bytes | memoryview | None]) -> int:
        """Gives back the buffers of ``get`` values the caller is done with (``values``
        is emptied): later Gets receive values of the same size into them instead of
        fresh memory, which costs page faults and zeroing for large values (~80 ms for
        64 MiB here). A buffer anything still references (a view, a tensor made from
        it) is left alone; at most ``receive_buffer_bytes`` are kept. Returns how many
        buffers were kept."""
        return self._buffers.give_back(values)

    def receive_into(self, allocate: Callable[[int], Any]) -> None:
        """Later Get values are received into buffers ``allocate(size)`` makes (a writable
        1-D byte buffer: the connector's worker on a GPU gives page-locked memory, which
        the GPU copies from by DMA); the buffers kept for reuse so far are dropped. Values
        gRPC delivers in one frame stay in gRPC's own memory."""
        self._buffers.allocate = allocate

    def put(self, items: Iterable[tuple[bytes, Value]], *, timeout_s: float | None = None) -> int:
        """Stores values; returns how many the tier stored. A value may be given as
        several buffers (e.g. a codec header and the payload): they are sent as one."""
        listed = [(key, _pieces(value)) for key, value in items]
        return self._call(lambda t, left: t.put(listed, timeout_s=left), timeout_s)

    def delete(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        return self._call(lambda t, left: t.delete(keys, timeout_s=left), timeout_s)

    def stats(self, *, timeout_s: float | None = None) -> cache_pb2.StatsResponse:
        return self._call(lambda t, left: t.stats(timeout_s=left), timeout_s)

    def _call(self, fn: Callable[[Transport, float], R], timeout_s: float | None) -> R:
        """``fn`` over this connection's transport, within one deadline."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        try:
            choice = self._choice
            if choice is None or time.monotonic() >= choice[1]:
                choice = self._pick(deadline)
            transport = choice[0]
            try:
                return fn(transport, _left(deadline))
            except TransportUnreachable as exc:
                return fn(self._unreachable(transport, exc, deadline), _left(deadline))
            except TierUnavailable:
                self._drop(transport)
                raise
        except TierRejected as exc:
            if exc.code == "UNAUTHENTICATED":
                self._reload_token()
            raise

    # -- the pick -------------------------------------------------------------------

    def _pick(self, deadline: float) -> tuple[Transport, float]:
        with self._lock:  # one pick at a time; the others take its result
            choice = self._choice
            if choice is None or time.monotonic() >= choice[1]:
                if choice is not None and choice[0] is not self._grpc:
                    choice[0].close()
                choice = self._choice = self._choose(deadline)
                logger.debug("kvtier: tier %s over %s", self.target, choice[0].name)
            return choice

    def _choose(self, deadline: float) -> tuple[Transport, float]:
        """The pick order of ``transport.py``: a transport and until when it stands."""
        if self.data_path == "grpc":
            return self._grpc, math.inf
        local = self._choose_local(deadline)
        if local is not None:
            return local, math.inf
        transport, until = self._choose_remote(deadline)
        # A local socket that did not answer is tried again when its wait is over.
        return transport, min(until, self._local_until) if self.local_socket else until

    def _choose_local(self, deadline: float) -> Transport | None:
        """The same-node transport when ``local_socket`` answers; None: use the next one."""
        if self.local_socket is None or self.data_path == "data":
            return None
        if self.data_path == "auto" and time.monotonic() < self._local_until:
            return None
        local = LocalTransport(
            self.local_socket,
            authorization=f"Bearer {self._token}" if self._token else None,
            buffers=self._buffers,
        )
        try:
            local.connect(timeout_s=_left(deadline))
        except TransportUnreachable as exc:
            local.close()
            if self.data_path == "local":
                raise TierUnavailable(f"UNAVAILABLE: {exc}") from exc
            self._local_until = time.monotonic() + DATA_RETRY_S
            warned, self._local_warned = self._local_warned, True
            (logger.debug if warned else logger.warning)(
                "kvtier: %s; using %s meanwhile, trying the socket again in %.0fs",
                exc,
                self.target,
                DATA_RETRY_S,
            )
            return None
        return local

    def _choose_remote(self, deadline: float) -> tuple[Transport, float]:
        """The data port or gRPC, over the network to ``target``."""
        settled = math.inf
        if self.data_path == "auto" and (
            self._data_host is None or time.monotonic() < self._grpc_until
        ):
            return self._grpc, self._grpc_until
        try:
            offer = self._grpc.stats(timeout_s=_left(deadline))
        except (TierUnavailable, TierRejected):
            if self.data_path == "data":
                raise
            return self._grpc, self._settle_on_grpc()
        if offer.data_port and self._data_host is not None:
            data = DataPortTransport(
                self._data_host,
                offer.data_port,
                control=self._grpc,
                authorization=f"Bearer {self._token}" if self._token else None,
                context=self._ssl,
                buffers=self._buffers,
            )
            return data, settled
        if self.data_path == "data":
            raise TierUnavailable(
                f"the tier at {self.target} has no data port reachable from here "
                "(start it with --data-port, or use data_path='auto')"
            )
        return self._grpc, self._settle_on_grpc()

    def _settle_on_grpc(self) -> float:
        self._grpc_until = time.monotonic() + DATA_RETRY_S
        return self._grpc_until

    def _unreachable(
        self, transport: Transport, exc: TransportUnreachable, deadline: float
    ) -> Transport:
        """The transport for a call whose transport could not reach the tier: for the data
        port gRPC ("auto": for ``DATA_RETRY_S``, logged once), for the local socket the
        next pick (the data port or gRPC, the socket tried again after ``DATA_RETRY_S``),
        or none ("data", "local")."""
        if self.data_path in ("data", "local"):
            self._drop(transport)
            raise TierUnavailable(f"UNAVAILABLE: {exc}") from exc
        if isinstance(transport, LocalTransport):
            self._local_until = time.monotonic() + DATA_RETRY_S
            self._drop(transport)
            logger.warning("kvtier: %s; using %s until the socket answers again", exc, self.target)
            return self._pick(deadline)[0]
        with self._lock:
            if self._choice is not None and self._choice[0] is transport:
                self._choice = (self._grpc, self._settle_on_grpc())
            warned, self._warned = self._warned, True
        transport.close()
        log = logger.debug if warned else logger.warning
        log(
            "kvtier: %s; moving values over gRPC, trying the data port again in %.0fs",
            exc,
            DATA_RETRY_S,
        )
        return self._grpc

    def _drop(self, transport: Transport) -> None:
        """Forget a transport that failed: the next call picks again."""
        with self._lock:
            if self._choice is None or self._choice[0] is not transport:
                return  # another thread picked again already
            self._choice = None
        if transport is not self._grpc:
            transport.close()

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
        with self._lock:  # data-port connections authenticate once, at connect: pick again
            self._token = token
            self._grpc.metadata = _metadata(token)
            choice, self._choice = self._choice, None
            self._grpc_until = 0.0
        if choice is not None and choice[0] is not self._grpc:
            choice[0].close()


def _left(deadline: float) -> float:
    """Seconds left until ``deadline`` (a spent deadline still gets a call that fails at once)."""
    return max(0.001, deadline - time.monotonic())


def _metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


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
