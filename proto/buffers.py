"""Recycled value buffers: a new value is received into the memory of one the RAM tier dropped.

A fresh ``bytearray`` of tens of MiB costs more than the bytes it receives:
above glibc's mmap threshold (at most 32 MiB) every allocation is new pages
from the kernel, zeroed by ``bytearray(n)`` and faulted in one by one, and
unmapped again when the value goes (docs/benchmarks.md, "Tier data path":
allocating a 64 MiB ``bytearray`` takes ~80 ms here, longer than receiving
64 MiB on loopback). So the RAM tier keeps the buffers of values it drops
(overwritten, evicted, deleted) in this pool, and a Put of the same size
(KV chunks of one model all have one size) receives into one of them.

Rules that keep it correct:

- A buffer enters the pool only when nothing else can still see it
  (``RamTier._forget``): a Get still sending the value, a write-behind copy
  waiting for its turn, or a promotion hold a view of it, and while any view
  is alive the buffer is not recycled (it is freed by Python when they go).
- A buffer leaves the pool only to be filled whole before it is stored (the
  data port and the gRPC Put store a value only once all its bytes arrived),
  so old bytes are never served.
- The pool is bounded by ``limit`` and its bytes count against the RAM tier's
  capacity: values + pooled buffers <= ``--ram-bytes``. Only values of at
  least ``MIN_BYTES`` are recycled; below that glibc reuses memory by itself.
"""

from __future__ import annotations

MIN_BYTES = 1 << 20


class BufferPool:
    """Free buffers by exact size, oldest first; single-threaded (the server's event loop)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self.reused = 0  # buffers handed out again (exported as a metric)
        self._free: list[bytearray] = []

    def __len__(self) -> int:
        return len(self._free)

    def take(self, size: int) -> bytearray:
        """A buffer of ``size`` bytes to receive a value into: a recycled one, or a new one."""
        if size >= MIN_BYTES:
            for i in range(len(self._free) - 1, -1, -1):
                if len(self._free[i]) == size:
                    self.bytes -= size
                    self.reused += 1
                    return self._free.pop(i)
        return bytearray(size)

    def wants(self, size: int) -> bool:
        """Whether a buffer of this size would be kept if there were room in the tier."""
        return size >= MIN_BYTES and self.bytes + size <= self.limit

    def keep(self, buf: bytearray, room: int) -> bool:
        """Keeps a buffer nobody else sees if it fits ``room`` (the tier's free bytes) and the limit."""
        n = len(buf)
        if n < MIN_BYTES or n > room or not self.wants(n):
            return False
        self._free.append(buf)
        self.bytes += n
        return True

    def shrink(self, most: int) -> None:
        """Drops the oldest buffers until the pool holds at most ``most`` bytes."""
        while self._free and self.bytes > most:
            self.bytes -= len(self._free.pop(0))

    def keep_only(self, size: int) -> None:
        """Drops every buffer of another size."""
        self._free = [b for b in self._free if len(b) == size]
        self.bytes = sum(map(len, self._free))

    def clear(self) -> None:
        self.shrink(0)
