"""The data port's byte streams: a plain socket (no copies) or TLS, each with a stall deadline.

``DataStream`` is what the data port's codec (``kvtier.cacheserver.dataport``)
reads requests from and writes replies to: ``recv_into`` fills the caller's
buffer (a value is received straight into the buffer the RAM tier keeps),
``send`` writes the caller's buffer (a stored value is sent as it is). Every
step waits at most ``timeout_s`` (``--data-timeout``) and raises
``TimeoutError`` past it, so a stalled peer is cut, a slow one that still makes
progress is not.

A failed socket operation leaves a reference cycle behind in asyncio (the
failed future holds the exception's traceback, whose frame holds the future
and the buffer being sent or filled), which would keep that buffer (a value
of up to ``--max-value-bytes``) alive until a full garbage collection. The
streams clear those frames when an operation fails (``_forget_buffers``), so
the buffer goes as soon as the request does.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import traceback
from typing import Protocol

from typing_extensions import Buffer

from kvtier.cacheserver.settings import Settings

# Large sends go in slices, each with its own deadline: a slow reader that
# still makes progress is not cut, a stalled one is.
SEND_SLICE = 8 << 20


class DataStream(Protocol):
    async def recv_into(self, view: memoryview) -> int:
        """Fills ``view``; returns the bytes that arrived (fewer: the peer closed)."""
        ...

    async def send(self, data: Buffer) -> None: ...

    def close(self) -> None: ...


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The data port's TLS context, from the same files as the gRPC port's credentials."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if settings.tls_client_ca_file is not None:
        ctx.load_verify_locations(cafile=str(settings.tls_client_ca_file))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class PlainStream:
    """A non-blocking socket read into and written from the caller's buffers (no copies)."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()

    async def recv_into(self, view: memoryview) -> int:
        got, n = 0, view.nbytes
        try:
            while got < n:
                async with asyncio.timeout(self.timeout_s):
                    k = await self.loop.sock_recv_into(self.sock, view[got:])
                if not k:
                    break
                got += k
        except OSError as exc:
            _forget_buffers(exc)
            raise
        return got

    async def send(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        try:
            for offset in range(0, view.nbytes, SEND_SLICE):
                async with asyncio.timeout(self.timeout_s):
                    await self.loop.sock_sendall(self.sock, view[offset : offset + SEND_SLICE])
        except OSError as exc:
            _forget_buffers(exc)
            raise

    def close(self) -> None:
        self.sock.close()


class TlsStream:
    """A TLS connection through asyncio's streams (decryption copies anyway)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout_s: float
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.timeout_s = timeout_s

    @classmethod
    async def accept(
        cls, sock: socket.socket, context: ssl.SSLContext, timeout_s: float
    ) -> TlsStream:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        protocol = asyncio.StreamReaderProtocol(reader)
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol, sock, ssl=context, ssl_handshake_timeout=timeout_s
        )
        return cls(reader, asyncio.StreamWriter(transport, protocol, reader, loop), timeout_s)

    async def recv_into(self, view: memoryview) -> int:
        got, n = 0, view.nbytes
        try:
            while got < n:
                async with asyncio.timeout(self.timeout_s):
                    data = await self.reader.read(min(n - got, 1 << 20))
                if not data:
                    break
                view[got : got + len(data)] = data
                got += len(data)
        except OSError as exc:
            _forget_buffers(exc)
            raise
        return got

    async def send(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        try:
            for offset in range(0, view.nbytes, 1 << 20):
                self.writer.write(view[offset : offset + (1 << 20)])
                async with asyncio.timeout(self.timeout_s):
                    await self.writer.drain()
        except OSError as exc:
            _forget_buffers(exc)
            raise

    def close(self) -> None:
        self.writer.close()


def _forget_buffers(exc: BaseException) -> None:
    """Clears the finished frames of a failed operation's traceback (the cycle through
    asyncio's failed future, see the module docstring); running frames are left alone."""
    traceback.clear_frames(exc.__traceback__)
