"""How ``TierClient``'s calls reach the tier: the ``Transport`` interface and the pick order.

A transport carries the five calls of ``kvtier.v1.CacheService`` (Lookup, Get, Put,
Delete, Stats) to one tier, each with a deadline, and raises only ``TierUnavailable``
or ``TierRejected`` (mapped through ``kvtier.connector.client.codes``), or
``TransportUnreachable`` when it cannot reach the tier at all from here. Values
arrive as ``bytes`` or read-only ``memoryview``s; a transport that receives values
into memory it allocates takes that memory from the client's ``ReceiveBuffers``.

Transports (``kvtier.connector.client``)::

    grpc.GrpcTransport          every call over the tier's gRPC port (always there)
    dataport.DataPortTransport  Get and Put over the tier's data port (raw bytes),
                                Lookup, Delete and Stats over gRPC
    local.LocalTransport        every call over the tier's Unix socket on this node,
                                values through shared memory (the same-node transport)

The pick: ``TierClient`` picks one transport per connection, on its first call and
again on the first call after its transport failed (``TierUnavailable``), after the
token changed, or after a temporary pick expired. It asks the tier's ``Stats`` once
and takes the first of this order that the tier offers and the client may use::

    1. the same-node transport, when ``local_socket`` is given, a connection to it opens
       and the tier there accepts the token, and ``data_path`` is "auto" or "local"
    2. the data port, when the tier advertises one (``StatsResponse.data_port``) on the
       gRPC target's host, and ``data_path`` is "auto" or "data"
    3. gRPC

``data_path="grpc"`` skips the pick (gRPC, no Stats call). With "auto", a local socket
that does not answer (no file, nobody listening, no permission) is tried again after
``DATA_RETRY_S`` (the pick of 2 or 3 stands until then; a socket that stops answering
later, e.g. while its tier restarts, does the same), and a pick that cannot use the
data port (no Stats answer, none advertised, or a connection to it cannot be opened:
``TransportUnreachable``, and that call goes over gRPC) settles on gRPC for
``DATA_RETRY_S`` before it asks again; with "local" or "data" each of these fails the
call.

Adding a transport: a class with this interface (one that moves only values can hand
the other calls to the gRPC transport, as ``DataPortTransport`` does), a way for the
client to learn of it (a field in ``StatsResponse``, or a setting such as
``local_socket``), and its place in ``TierClient._choose``, which is the pick order
above in code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from typing_extensions import Buffer

from kvtier.proto import cache_pb2

Values = list[bytes | memoryview | None]
"""The values of a Get in key order (None: a miss)."""
Items = Sequence[tuple[bytes, Sequence[Buffer]]]
"""The items of a Put: each key's value as one or more buffers, sent as one value."""


class TransportUnreachable(Exception):
    """The transport cannot reach the tier from here (connection refused, no route, a
    TLS or handshake failure before any request was sent): another transport may."""


class Transport(Protocol):
    name: str
    """Short name for logs ("grpc", "data")."""

    def lookup(self, keys: Sequence[bytes], *, timeout_s: float) -> int: ...

    def get(
        self, keys: Sequence[bytes], *, stop_at_first_miss: bool, timeout_s: float
    ) -> Values: ...

    def put(self, items: Items, *, timeout_s: float) -> int: ...

    def delete(self, keys: Sequence[bytes], *, timeout_s: float) -> int: ...

    def stats(self, *, timeout_s: float) -> cache_pb2.StatsResponse: ...

    def close(self) -> None:
        """Release what the transport holds (connections); the client's gRPC transport
        is closed only with the client."""
