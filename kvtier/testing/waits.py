"""Polling for a condition that a server makes true after it answered (a metric counted
once the reply is sent, a file renamed into place behind a write)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    """Whether ``condition()`` became true within ``timeout_s`` (polled every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()
