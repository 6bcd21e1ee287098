"""The data-port edge: Get and Put values as raw bytes on a TCP stream, beside the gRPC port.

gRPC moves every value through protobuf messages: built, copied into grpc's
buffers, and reassembled from frames, three user-space copies per value
(docs/benchmarks.md, "Tier data path"). Here a value crosses none: a PUT is
received straight into the ``bytearray`` that the RAM tier then keeps (as a
read-only view; recycled from a dropped value of the same size when the tier
has one, ``kvtier.proto.buffers``), and a GET sends a view of the stored object.

The format is ``kvtier.proto.datawire`` (docs/protocol.md, "Data port"). Each
connection (``kvtier.cacheserver.dataconnection``) only decodes it into calls
on the same ``RequestCore`` as the gRPC servicer (tenants, limits, the store,
metrics: ``kvtier.cacheserver.core``) and maps the core's errors to status
numbers; this module is the listener. The HELLO
preamble carries the authorization value, checked again on every request so a
revoked token stops working at once. Metrics ops are ``DataHello``,
``DataGet``, ``DataPut`` and ``DataInvalid`` (a request whose op cannot be
read). A value is stored only once all its bytes arrived; a connection that
stalls for ``--data-timeout`` (idle, or inside a request) is closed, and a
request's header and table must arrive whole within it (a peer that dribbles
them a byte at a time is cut too). At most ``--data-max-connections`` are
open; one more is closed at once. One task per connection, on the server's
event loop; the byte streams (plain or TLS) are ``kvtier.cacheserver.datastreams``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time

from kvtier.cacheserver.core import RequestCore
from kvtier.cacheserver.dataconnection import STATUSES, DataConnection, status_of

__all__ = ["STATUSES", "DataPort", "status_of"]

logger = logging.getLogger(__name__)


class DataPort:
    """The listener and its connections; ``start()`` binds, ``close(grace)`` stops."""

    def __init__(self, core: RequestCore, context: ssl.SSLContext | None = None) -> None:
        self.core = core
        self.settings = core.settings
        self.context = context
        self.port = 0
        self.closing = False
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: dict[asyncio.Task[None], DataConnection] = {}
        self._warned = -float("inf")

    async def start(self) -> int:
        host, port = self.settings.host, self.settings.data_port
        try:
            family, _, _, _, address = socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            listener = socket.create_server(address, family=family, backlog=128)
        except OSError as exc:
            raise OSError(
                f"cannot listen on {host}:{port} for the data port (--data-port): {exc}"
            ) from exc
        listener.setblocking(False)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._accepting = asyncio.create_task(self._accept_loop(listener))
        return self.port

    async def close(self, grace_s: float) -> None:
        """Stops accepting, closes idle connections, gives busy ones ``grace_s`` to finish."""
        self.closing = True
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._listener is not None:
            self._listener.close()
        for task, conn in list(self._connections.items()):
            if conn.idle:
                task.cancel()
        tasks = list(self._connections)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(listener)
            except OSError as exc:  # out of file descriptors, ...: back off, keep serving
                logger.warning("data port: accept failed (%s)", exc)
                await asyncio.sleep(0.1)
                continue
            if len(self._connections) >= self.settings.data_max_connections:
                sock.close()
                self.core.metrics.data_connections_refused.inc()
                self._warn_full()
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            name = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
            conn = DataConnection(self.core, self.context, name, lambda: self.closing)
            task = asyncio.create_task(conn.serve(sock))
            self._connections[task] = conn
            task.add_done_callback(self._forget)
            self.core.metrics.data_connections.set(len(self._connections))

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._connections.pop(task, None)
        self.core.metrics.data_connections.set(len(self._connections))

    def _warn_full(self) -> None:
        now = time.monotonic()
        if now - self._warned >= 10:
            self._warned = now
            logger.warning(
                "data port: %d connections open (--data-max-connections): closing new ones at "
                "once (clients move values over gRPC meanwhile)",
                len(self._connections),
            )


