"""What the two socket transports share (``DataPortTransport``, ``LocalTransport``).

A call's deadline over each of its socket operations, the tier's refusal of a request,
and ``ConnectionPool``: a few persistent connections (thread-safe: the connector calls
from several threads; a call takes a connection, or opens one, and gives it back) and
the one mapping of a failed call to the client's errors. A connection that failed is
closed, never reused; a pooled one the tier closed while idle (``--data-timeout``) is
replaced and the call tried once more (every call is idempotent).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from kvtier.connector.client.codes import code_name, tier_error
from kvtier.connector.errors import TierUnavailable

T = TypeVar("T")
MAX_IDLE = 4
CONNECT_TIMEOUT_S = 1.0


class Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.end = time.monotonic() + timeout_s

    def arm(self, sock: socket.socket) -> None:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline exceeded")
        sock.settimeout(left)

    def connect_timeout(self) -> float:
        """The time an attempt to connect may take: ``CONNECT_TIMEOUT_S`` at most."""
        return max(0.001, min(CONNECT_TIMEOUT_S, self.end - time.monotonic()))


class Refused(Exception):
    """The tier answered a request with an error status (and, for a Put, a count)."""

    def __init__(self, status: int, message: str, count: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.count = count


class Broken(Exception):
    """The connection cannot be trusted any more (closed under a lease, a bad checksum)."""


class Connection(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Connection)


class ConnectionPool(Generic[C]):
    """Persistent connections and ``_call``; a transport adds ``_connect`` and ``where``
    (what its errors name: "data port HOST:PORT", "local socket PATH")."""

    where: str

    def __init__(self, max_idle: int) -> None:
        self.max_idle = max_idle
        self._idle: list[C] = []
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _connect(self, deadline: Deadline) -> C:
        raise NotImplementedError

    def _call(self, op: str, fn: Callable[[C, Deadline], T], timeout_s: float) -> T:
        deadline = Deadline(timeout_s)
        for attempt in (0, 1):
            conn, reused = self._acquire(deadline)
            try:
                result = fn(conn, deadline)
            except Refused as exc:
                conn.close()  # the tier may close after an error: never reuse
                raise tier_error(op, code_name(exc.status), str(exc)) from exc
            except Broken as exc:
                conn.close()
                raise TierUnavailable(f"{op}: DATA_LOSS: {exc}") from exc
            except TimeoutError as exc:
                conn.close()
                raise TierUnavailable(
                    f"{op}: DEADLINE_EXCEEDED: no answer on the {self.where} within {timeout_s:g}s"
                ) from exc
            except (OSError, ConnectionError) as exc:
                conn.close()
                if reused and attempt == 0:
                    continue  # the tier closed this idle connection: once more on a new one
                raise TierUnavailable(f"{op}: UNAVAILABLE: {self.where}: {exc}") from exc
            except BaseException:
                conn.close()
                raise
            self._release(conn)
            return result
        raise AssertionError("unreachable")

    def _acquire(self, deadline: Deadline) -> tuple[C, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(deadline), False

    def _release(self, conn: C) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()
