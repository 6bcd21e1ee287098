"""A TCP proxy in front of the tier that can fail the tier at an exact moment.

Engine -> proxy (fixed port) -> tier. With ``data_upstream`` it proxies the
tier's data port too: a client reaches the data port on the gRPC target's host
at the port the tier advertises, so the proxy listens on another loopback
address (``host``, e.g. 127.0.0.2) at the tier's gRPC-side port of its choice
and at the data port's own number; the faults below count and cut both. ``cut_after(n)``: once ``n`` more bytes
have flowed from the tier to the engine, every connection is reset (the tier
"dies mid-load"). ``stall_after(n)``: after ``n`` bytes, tier-to-engine traffic
stops until ``release()`` (the tier "freezes mid-load"). ``close()`` stops
listening (the tier is "absent"); ``listen()`` starts again on the same port.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class FaultProxy:
    def __init__(
        self,
        upstream: tuple[str, int],
        port: int = 0,
        *,
        data_upstream: tuple[str, int] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        if data_upstream is not None and data_upstream[0] == host:
            raise ValueError("the data port is proxied at its own number: listen on another host")
        self.upstream = upstream
        self.data_upstream = data_upstream
        self.host = host
        self.port = port
        self._lock = threading.Lock()
        self._budget: int | None = None
        self._mode = ""
        self._released = threading.Event()
        self._released.set()
        self._conns: list[socket.socket] = []
        self._server: socket.socket | None = None  # the gRPC-side listener (None: closed)
        self._servers: list[socket.socket] = []

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def listen(self) -> FaultProxy:
        self._server = self._listen(self.port, self.upstream)
        self.port = self._server.getsockname()[1]
        if self.data_upstream is not None:
            self._listen(self.data_upstream[1], self.data_upstream)
        return self

    def _listen(self, port: int, upstream: tuple[str, int]) -> socket.socket:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((self.host, port))
        server.listen(64)
        self._servers.append(server)
        threading.Thread(target=self._accept, args=(server, upstream), daemon=True).start()
        return server

    def close(self) -> None:
        """Stop listening and reset every open connection."""
        servers, self._servers, self._server = self._servers, [], None
        for server in servers:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()
        self.reset_all()

    def cut_after(self, nbytes: int) -> None:
        with self._lock:
            self._budget, self._mode = nbytes, "cut"

    def stall_after(self, nbytes: int) -> None:
        with self._lock:
            self._budget, self._mode = nbytes, "stall"
            self._released.clear()

    def release(self) -> None:
        with self._lock:
            self._budget, self._mode = None, ""
        self._released.set()

    @property
    def tripped(self) -> bool:
        with self._lock:
            return self._budget is not None and self._budget <= 0

    def reset_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            _reset(conn)

    # -- internals -----------------------------------------------------------------------

    def _accept(self, server: socket.socket, target: tuple[str, int]) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(target, timeout=2)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if downstream:
                    data = self._admit(data)
                    if data is None:
                        self.reset_all()
                        return
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _admit(self, data: bytes) -> bytes | None:
        """The part of ``data`` to forward now (None: reset everything)."""
        with self._lock:
            budget, mode = self._budget, self._mode
            if budget is None:
                return data
            self._budget = budget - len(data)
        if budget - len(data) > 0:
            return data
        if mode == "cut":
            return None
        self._released.wait()
        return data


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
