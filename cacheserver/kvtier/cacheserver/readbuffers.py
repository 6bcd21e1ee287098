"""Buffers that Gets of the disk and Redis tiers read records into, reused once nothing
holds the value read into them.

Memory the kernel has to allocate and zero costs more than the read itself on these
machines (a 64 MiB record: 0.85 GB/s into new memory, 2.3 GB/s into memory touched
before: docs/benchmarks.md, "Redis tier against redis-py, disk tier against plain
files"). At most ``READ_BUFFER_BYTES`` of such buffers are kept per tier, outside
``--ram-bytes``; records under ``READ_BUFFER_MIN`` get new memory (glibc reuses it).
"""

from __future__ import annotations

import sys
import threading

READ_BUFFER_BYTES = 256 << 20  # read buffers kept for reuse, at most
READ_BUFFER_MIN = 1 << 20  # smaller records: glibc reuses their memory by itself


class ReadBuffers:
    """Buffers Gets read records into, each reused once nothing else holds it (thread-safe:
    the disk tier reads in worker threads). A value handed out is a view of its buffer,
    and a view keeps a reference to it, so a buffer whose only references are this pool's
    is not being sent, promoted or held by anybody: its bytes may be overwritten."""

    def __init__(self, limit: int = READ_BUFFER_BYTES) -> None:
        self.limit = limit
        self.reused = 0
        self._kept: list[bytearray] = []  # oldest first
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        if size < READ_BUFFER_MIN or size > self.limit:
            return bytearray(size)
        with self._lock:
            for i in range(len(self._kept)):  # (enumerate's tuple would hold one more)
                buf = self._kept[i]
                # References: the list's, ``buf``'s and getrefcount's argument; no one else's.
                if len(buf) == size and sys.getrefcount(buf) == 3:
                    del self._kept[i]
                    self._kept.append(buf)
                    self.reused += 1
                    return buf
        fresh = bytearray(size)  # outside the lock: new memory costs page faults
        with self._lock:
            self._kept.append(fresh)
            kept = sum(map(len, self._kept))
            while kept > self.limit:  # forgotten, not freed: whoever holds it still may
                kept -= len(self._kept.pop(0))
        return fresh
