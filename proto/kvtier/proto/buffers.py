"""Recycled value buffers: a new value is received into the memory of one that was dropped.

Used on both ends of the wire: the tier's RAM tier (``kvtier.cacheserver.ram``)
receives Puts into the buffers of values it dropped, and the tier client
(``kvtier.connector.client``) receives Get values into the buffers of values its
caller gave back (``ReceiveBuffers``).

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
  capacity: values + pooled buffers <= ``--ram-bytes``. The newest buffers
  stay: keeping one drops the oldest as needed, so a pool filled by values of
  one size serves the next size that comes. Only values of at least
  ``MIN_BYTES`` are recycled; below that glibc reuses memory by itself.

Debugging a suspected reuse (a buffer read after it was given back): with
``KVTIER_POISON_RECYCLED=1`` in a process's environment, every buffer its pools of this
module keep (a client's ``ReceiveBuffers``, the RAM tier's recycled buffers; not the
disk and Redis tiers' read buffers, ``kvtier.cacheserver.readbuffers``) is filled with
0xFF bytes first (a NaN in bfloat16, float16 and float32), so such a read
sees poison at once instead of, now and then, the next value's bytes. The contention
tests (tests/e2e/test_vllm_contention.py, tests/recipes/test_contention.py) run their
engines and tier with it; it costs a write of every recycled byte, so it is off by
default.

A client's pool can make its buffers with another allocator (``ReceiveBuffers.allocate``):
the connector's worker on a GPU receives into page-locked (pinned) host memory, which
the GPU copies from by DMA. Such a buffer is any writable 1-D byte buffer with ``len``
and slice assignment (the worker's: a numpy array over a pinned torch tensor); buffers
of another kind given back are not kept, so a pool never mixes the two.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, MutableSequence
from typing import Any

MIN_BYTES = 1 << 20
POISON_ENV = "KVTIER_POISON_RECYCLED"


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
        buf = self.reuse(size)
        return buf if buf is not None else bytearray(size)

    def reuse(self, size: int) -> bytearray | None:
        """A recycled buffer of exactly ``size`` bytes, or None."""
        if size >= MIN_BYTES:
            for i in range(len(self._free) - 1, -1, -1):
                if len(self._free[i]) == size:
                    self.bytes -= size
                    self.reused += 1
                    return self._free.pop(i)
        return None

    def wants(self, size: int) -> bool:
        """Whether a buffer of this size would be kept if there were room in the tier."""
        return size >= MIN_BYTES and self.bytes + size <= self.limit

    def keep(self, buf: bytearray, room: int) -> bool:
        """Keeps a buffer nobody else sees, within the limit and ``room`` (the tier's free
        bytes, which grow by what the pool drops). The newest buffers win: older ones are
        dropped to make room, so a pool full of one size adapts when values of another
        size arrive (another model's chunks, or after a change of chunk size)."""
        n = len(buf)
        if n < MIN_BYTES or n > self.limit or n > room + self.bytes:
            return False
        self.shrink(min(self.limit - n, self.bytes - max(0, n - room)))
        if os.environ.get(POISON_ENV, "") not in ("", "0"):
            poison(buf)
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


def poison(buf: Any) -> None:
    """Fills a buffer with 0xFF bytes (``POISON_ENV``), in place."""
    with memoryview(buf) as view:
        n = view.nbytes
    if n:
        raw = (ctypes.c_char * n).from_buffer(buf)
        ctypes.memset(ctypes.addressof(raw), 0xFF, n)
        del raw  # its export of ``buf`` goes with it


class ReceiveBuffers:
    """A thread-safe pool for a client: Get values are received into buffers of
    values the caller gave back (``give_back``), at most ``limit`` bytes of them kept."""

    def __init__(self, limit: int) -> None:
        self._pool = BufferPool(limit)
        self._lock = threading.Lock()
        self._allocate: Callable[[int], Any] = bytearray
        self._kind: type = bytearray

    @property
    def allocate(self) -> Callable[[int], Any]:
        """Makes a new buffer of the given size (``bytearray`` unless set)."""
        return self._allocate

    @allocate.setter
    def allocate(self, allocate: Callable[[int], Any]) -> None:
        kind = type(allocate(0))
        with self._lock:  # buffers of the old kind go: every buffer handed out is of one kind
            self._pool.clear()
            self._allocate, self._kind = allocate, kind

    @property
    def reused(self) -> int:
        return self._pool.reused

    @property
    def bytes(self) -> int:
        return self._pool.bytes

    def take(self, size: int) -> bytearray:
        """A buffer to receive a value of ``size`` bytes into; fill it whole (a recycled
        buffer holds an old value's bytes). Typed ``bytearray``: another allocator's
        buffers behave as one for receiving (``len``, slices, the buffer protocol)."""
        if size >= MIN_BYTES and self._pool.limit:
            with self._lock:
                buf = self._pool.reuse(size)
            if buf is not None:
                return buf
        fresh: bytearray = self._allocate(size)  # outside the lock: a large one costs page faults
        return fresh

    def give_back(self, values: MutableSequence[Any]) -> int:
        """Takes the buffers of Get values the caller is done with; empties ``values``.
        A buffer is kept only when nothing else still sees it (a view, a tensor made
        from it): such a value is left alone. Returns how many buffers were kept."""
        kept = 0
        while values:
            value = values.pop()
            if not isinstance(value, memoryview):
                continue
            buf: Any = value.obj
            size = value.nbytes
            del value
            ours = type(buf) is self._kind  # (a test apart: ``is`` would narrow ``buf``)
            if not ours or size != len(buf):
                continue  # not a whole received buffer
            if size < MIN_BYTES or size > self._pool.limit:
                continue
            # As in RamTier._forget: with no view of ``buf`` alive, the only references
            # left are ``buf`` here and getrefcount's argument (CPython counts exactly).
            if sys.getrefcount(buf) == 2:
                with self._lock:  # the newest buffers stay: the oldest are dropped for room
                    kept += self._pool.keep(buf, self._pool.limit)
        return kept
