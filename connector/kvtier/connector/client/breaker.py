"""A circuit breaker in front of the tier, so a dead tier costs one deadline, not one per call.

States::

    closed     calls go through; ``failures`` consecutive failures open it
    open       calls are refused (the caller recomputes) for ``cooldown_s``
    half-open  one probe call goes through: success closes, failure reopens

Thread-safe: the scheduler thread, the engine thread and the background sender
share one breaker per process.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failures: int,
        cooldown_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_open: Callable[[], None] | None = None,
    ) -> None:
        self._threshold = failures
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._on_open = on_open
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """Whether a call may go to the tier now. Each True must be followed by
        ``success()`` or ``failure()``."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN:
                if self._clock() - self._opened_at < self._cooldown_s:
                    return False
                self._state = BreakerState.HALF_OPEN
                self._probing = False
            if self._probing:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._probing = False

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            self._probing = False
            if self._state is BreakerState.HALF_OPEN or self._failures >= self._threshold:
                opened = self._state is BreakerState.CLOSED
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()
            else:
                opened = False
        if opened and self._on_open is not None:
            self._on_open()
