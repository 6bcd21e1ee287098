"""The same-node edge: control messages on a Unix socket, values through shared memory.

With ``--local-socket PATH`` the tier also listens on a Unix stream socket. A client on
the same node (an engine's connector, through a mounted directory) sends the five calls
there (``kvtier.proto.localwire``; docs/protocol.md, "Same-node transport"), and bulk
bytes never cross the socket:

- **Get**: the RAM tier's values live in memfd segments (``kvtier.cacheserver.arena``).
  The reply says where each value lies (segment, offset, length, checksum); the first
  time a connection needs a segment, the reply carries a read-only file descriptor of
  it (``SCM_RIGHTS``). The client copies the values out, checks their checksums, and
  sends RELEASE. Until then the connection holds a *lease*: views of those values, so
  their memory is not reused even if they are replaced, evicted or deleted meanwhile.
  A value not in a segment (small, or read from a lower tier) follows the reply inline.
- **Put**: the client reserves room (RESERVE: extents of its tenant's own segments,
  whose read-write descriptors go to that tenant's connections only), writes each value
  there and sends PUT with ``FLAG_RESERVED``; the tier stores the extents themselves,
  with the checksums the client sent: one copy. Without room (or for a value only the
  disk tier takes) the connection gets a staging segment of its own (STAGE: a writable
  memfd, reserved from ``--incoming-bytes`` while the connection keeps it); the client
  writes values into it and sends PUT with their offsets, lengths and checksums; the
  tier copies each into a new extent of its own segments (the client can never write
  there), checks the checksum of what it copied, and stores it.

This module is the listener: the socket file (a stale one replaced, a live one or
another file refused, mode 0660, removed at shutdown if still ours) and the
connections' lifetime. One client's requests, leases and staging segment are
``kvtier.cacheserver.localconn``. Everything else is the request core's
(``kvtier.cacheserver.core``): tenants, validation, limits, the store, metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from pathlib import Path

from kvtier.cacheserver.arena import SharedArena
from kvtier.cacheserver.core import RequestCore
from kvtier.cacheserver.localconn import LocalConnection

logger = logging.getLogger(__name__)

SOCKET_MODE = 0o660


class LocalPort:
    """The Unix socket listener and its connections; ``start()`` binds, ``close(grace)`` stops."""

    def __init__(self, core: RequestCore, arena: SharedArena, path: Path) -> None:
        self.core = core
        self.arena = arena
        self.path = path
        self.closing = False
        self.leased_bytes = 0  # of every connection's lease (a gauge)
        self.lease_timeouts = 0  # connections closed for holding a lease too long
        self._listener: socket.socket | None = None
        self._inode = 0
        self._accepting: asyncio.Task[None] | None = None
        self._connections: dict[asyncio.Task[None], LocalConnection] = {}

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        try:
            _remove_stale(self.path)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(str(self.path))
                os.chmod(self.path, SOCKET_MODE)
                listener.listen(128)
            except OSError:
                listener.close()
                raise
        except OSError as exc:
            raise OSError(
                f"cannot serve the local socket {self.path} (--local-socket): {exc}"
            ) from exc
        listener.setblocking(False)
        self._listener = listener
        self._inode = os.stat(self.path).st_ino
        self._accepting = asyncio.create_task(self._accept_loop(listener))

    async def close(self, grace_s: float) -> None:
        """Stops accepting, closes idle connections, gives busy ones ``grace_s`` to finish."""
        self.closing = True
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == self._inode:  # still ours: not a newer tier's
                    os.unlink(self.path)
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
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of file descriptors, ...: back off, keep serving
                logger.warning("local socket: accept failed (%s)", exc)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            conn = LocalConnection(self, sock)
            task = asyncio.create_task(conn.serve())
            self._connections[task] = conn
            task.add_done_callback(self._connections.pop)


def _remove_stale(path: Path) -> None:
    """Removes a socket file nobody listens on; refuses a live socket or another file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        os.unlink(path)  # stale: left by a tier that is gone
        return
    finally:
        probe.close()
    raise OSError(f"another process (a running tier?) listens on {path}")
