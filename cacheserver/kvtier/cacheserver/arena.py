"""The RAM tier's memory for a same-node transport: memfd segments it shares read-only.

With ``--local-socket`` the RAM tier keeps every value of ``SHARED_MIN`` bytes or more
in memfd segments instead of Python ``bytearray``s, so that a client on the same node
can copy a value straight out of the tier's memory (``kvtier.cacheserver.localport``):
the tier hands it a read-only file descriptor of the segment and says where the value
lies. Smaller values stay on the heap and travel inline. A segment is sealed once the
tier has mapped it (``F_SEAL_FUTURE_WRITE``, ``F_SEAL_SHRINK``, ``F_SEAL_GROW``,
``F_SEAL_SEAL``): nobody can write to it, map it writable, punch holes in it or change
its size from then on, not even a client that opens its descriptor again read-write
through ``/proc``; only the tier's own mapping writes. Linux 5.1 or later.

How memory is handed out and taken back:

- ``take(size)`` carves a page-aligned extent out of a segment (best fit; a new segment
  when none has room, while the segments stay within ``limit_bytes``) and returns a
  writable view of exactly ``size`` bytes, or None (a small value, or no room: the
  caller uses the heap, and that value travels inline).
- Every view of an extent is a view of one exporter object (a ctypes array over the
  segment's mapping), so the extent is free again exactly when its last view is gone
  (a weakref callback queues it; queued extents are freed by the next ``take``). The
  RAM tier's entry, a Get being sent, a write-behind copy waiting and a same-node
  client's lease each hold a view: replacing or evicting a value never changes bytes
  anybody may still read, and a value's memory is reused only once nobody can.
- Free extents are coalesced and reused; their pages stay mapped (as the recycled
  buffers of ``kvtier.proto.buffers`` do), so a reused extent costs no page faults.
  The tier's sealed segments are never shrunk or closed while the server runs (clients
  map them); a tenant's writable ones may be (below).
- **Every segment holds one tenant's values** (``owner``): a Get hands a client
  descriptors of whole segments, so a segment shared by tenants would let one read
  another's values. Each tenant has its own sealed segments (``take(size, tenant)``)
  and its own writable ones (``writable=True``).

A value's checksum (xxh3-64, ``kvtier.proto.localwire.checksum``) is kept with its
extent: set by the same-node Put that copied it in, computed on first use otherwise
(the extent's bytes never change while it is in use).

**A tenant's writable segments** (``take(size, tenant, writable=True)``): a same-node Put of one copy
(RESERVE, then PUT with ``FLAG_RESERVED``) has the client write a value straight into
tier memory. The tier cannot take a writable mapping back from another process, so
such memory is only ever used for values of the tenant whose clients got it: these
segments are sealed against a change of size only (no ``F_SEAL_FUTURE_WRITE``),
their read-write descriptor goes to that tenant's connections, and their extents are
never handed to anybody else. A client can thus change its own tenant's values after
storing them, as it could have stored other bytes in the first place: readers on the
node check the checksum recorded when the value was stored; copies to lower tiers and
replies over TCP carry what that tenant's memory holds. No other tenant's value is ever
in it. A writable segment that is wholly free is closed when another segment needs its
room: its pages are released first (hole punched), so the mappings clients keep of it
cost no memory (unless a client writes into its stale mapping again: then its own), and
its id is never used again. Revoking a token does not unmap what its holder was given.
Before a reservation is handed out the tier faults its pages in through its own mapping
(``populate``, once per page): memory is charged to the cgroup that first touches it, and
tier memory must count against the tier's pod, not against the engine that writes it
first.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.proto.localwire import checksum

PAGE = mmap.PAGESIZE
SHARED_MIN = 64 << 10  # smaller values stay on the heap (a page each would waste memory)
SEGMENT_BYTES = 256 << 20  # a segment's size (a larger value gets a segment of its own)
_ATTR = "_kvtier_extent"
F_SEAL_FUTURE_WRITE = 0x10  # linux/fcntl.h (Linux 5.1); Python's fcntl does not name it
MADV_POPULATE_WRITE = 23  # linux/mman.h (Linux 5.14)
_libc = ctypes.CDLL(None, use_errno=True)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memfd(name: str, size: int, seals: int) -> tuple[int, mmap.mmap]:
    """A memfd of ``size`` bytes, mapped read-write here, then sealed with ``seals``."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        except OSError:
            mapped.close()
            raise
    except OSError:
        os.close(fd)
        raise
    return fd, mapped


class Segment:
    """One memfd of one tenant's values: the tier's read-write mapping and the read-only
    fd handed to that tenant's clients (and, for a writable segment, ``fd``, read-write)."""

    def __init__(self, segment_id: int, size: int, owner: str, writable: bool = False) -> None:
        self.id = segment_id
        self.size = size
        self.owner = owner
        self.writable = writable
        self.fd, self.map = sealed_memfd(
            f"kvtier-ram-{segment_id}", size, SEALS if writable else SEALS | F_SEAL_FUTURE_WRITE
        )
        try:
            self.read_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # no /proc: the seals alone keep clients from writing
            self.read_fd = os.dup(self.fd)
        self.free: list[tuple[int, int]] = [(0, size)]  # (offset, length), by offset
        exporter = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(exporter)  # valid while the map is open
        del exporter
        # a writable segment: which pages the tier has faulted in (one byte per page)
        self.populated = bytearray(size // PAGE if writable else 0)

    def populate(self, offset: int, span: int) -> None:
        """Faults the pages of ``span`` bytes at ``offset`` in through the tier's mapping, once
        each (any thread: the caller holds the extent)."""
        first, last = offset // PAGE, (offset + span) // PAGE
        if self.populated.find(0, first, last) < 0:
            return
        where = ctypes.c_void_p(self.address + offset)
        if _libc.madvise(where, ctypes.c_size_t(span), MADV_POPULATE_WRITE) != 0:
            error = ctypes.get_errno()
            if error != errno.EINVAL:  # out of memory, ...: no reservation
                raise OSError(error, f"madvise(MADV_POPULATE_WRITE): {os.strerror(error)}")
            ctypes.memset(where, 0, span)  # before Linux 5.14 (the extent is free: about to be written)
        self.populated[first:last] = b"\x01" * (last - first)

    def idle(self) -> bool:
        return self.free == [(0, self.size)]

    def close(self) -> None:
        if self.writable:  # clients may keep it mapped: its pages go now
            with contextlib.suppress(OSError):
                _punch(self.fd, self.size)
        with contextlib.suppress(OSError):
            os.close(self.read_fd)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(BufferError):  # views still alive: unmapped with them
            self.map.close()


@dataclass
class Extent:
    """Where one value's memory lies (``length`` bytes at ``offset``, ``span`` reserved)."""

    segment: int
    offset: int
    length: int
    span: int
    checksum: int | None = None
    ref: weakref.ref[object] | None = field(default=None, repr=False)


class SharedArena:
    """Extents of memfd segments, freed when their last view goes; single-threaded (the
    server's event loop), except that a view may die in any thread."""

    def __init__(self, limit_bytes: int, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self.segment_bytes = max(PAGE, min(segment_bytes, _pages(limit_bytes)))
        self.segments: dict[int, Segment] = {}
        self.total_bytes = 0  # of every segment
        self.used_bytes = 0  # of extents alive
        self.fallbacks = 0  # values that did not fit and went to the heap
        self._next_id = 1  # segment ids are never reused (clients keep closed ones mapped)
        self._extents: dict[int, Extent] = {}
        self._dead: list[Extent] = []  # appended from weakref callbacks, any thread

    def take(self, size: int, tenant: str, writable: bool = False) -> memoryview | None:
        """A writable view of ``size`` bytes of ``tenant``'s shared memory, or None (small,
        or no room); ``writable``: from the segments that tenant's clients may write."""
        if size < SHARED_MIN:
            return None
        self.reclaim()
        span = _pages(size)
        try:
            where = self._alloc(span, tenant, writable)
        except OSError:  # no memfd now (out of descriptors or memory): the heap, or staging
            where = None
        if where is None:
            self.fallbacks += 1
            return None
        segment, offset = where
        exporter = (ctypes.c_char * span).from_buffer(segment.map, offset)
        extent = Extent(segment.id, offset, size, span)
        setattr(exporter, _ATTR, extent)
        extent.ref = weakref.ref(exporter, self._when_gone(extent))
        self._extents[id(extent)] = extent
        self.used_bytes += span
        return memoryview(exporter).cast("B")[:size]

    def _when_gone(self, extent: Extent) -> Callable[[weakref.ref[object]], None]:
        def gone(_ref: weakref.ref[object]) -> None:
            self._dead.append(extent)  # any thread: list.append is atomic

        return gone

    def locate(self, value: object) -> Extent | None:
        """The extent ``value`` is a whole view of, or None (heap memory, or a part)."""
        if not isinstance(value, memoryview):
            return None
        extent = getattr(value.obj, _ATTR, None)
        if not isinstance(extent, Extent) or value.nbytes != extent.length:
            return None
        return extent

    def checksum(self, value: memoryview, extent: Extent) -> int:
        if extent.checksum is None:
            extent.checksum = checksum(value)
        return extent.checksum

    def unpopulated(self, view: memoryview) -> bool:
        """Whether some page of a writable extent (``take``'s view) was never faulted in."""
        extent = self.locate(view)
        segment = None if extent is None else self.segments.get(extent.segment)
        if extent is None or segment is None:
            return False
        first = extent.offset // PAGE
        return segment.populated.find(0, first, first + extent.span // PAGE) >= 0

    def populate(self, views: list[memoryview]) -> None:
        """``Segment.populate`` for the extents of ``views`` (any thread: the views keep
        the segments mapped while it runs)."""
        for view in views:
            extent = self.locate(view)
            segment = None if extent is None else self.segments.get(extent.segment)
            if extent is not None and segment is not None:
                segment.populate(extent.offset, extent.span)

    def live_bytes(self) -> int:
        """Bytes of extents still viewed (readable from any thread: changes nothing)."""
        return self.used_bytes - sum(e.span for e in list(self._dead))

    def reclaim(self) -> None:
        """Frees the extents whose last view is gone (the event loop's thread only)."""
        while self._dead:
            extent = self._dead.pop()
            if self._extents.pop(id(extent), None) is None:
                continue
            self.used_bytes -= extent.span
            segment = self.segments.get(extent.segment)
            if segment is not None:
                _insert_free(segment.free, extent.offset, extent.span)

    def close(self) -> None:
        for segment in self.segments.values():
            segment.close()
        self.segments.clear()

    def _alloc(self, span: int, owner: str, writable: bool) -> tuple[Segment, int] | None:
        best: tuple[Segment, int, int] | None = None  # segment, index in its free list, length
        for segment in self.segments.values():
            if segment.owner != owner or segment.writable != writable:
                continue
            for i, (_offset, length) in enumerate(segment.free):
                if length >= span and (best is None or length < best[2]):
                    best = (segment, i, length)
                    if length == span:
                        break
        if best is None:
            size = max(self.segment_bytes, span)
            if self.total_bytes + size > self.limit_bytes:
                self._close_idle(self.total_bytes + size - self.limit_bytes)
            if self.total_bytes + size > self.limit_bytes and self.segments:
                return None
            segment = Segment(self._next_id, size, owner, writable)
            self._next_id += 1
            self.segments[segment.id] = segment
            self.total_bytes += size
            best = (segment, 0, size)
        segment, i, length = best
        offset = segment.free[i][0]
        if length == span:
            del segment.free[i]
        else:
            segment.free[i] = (offset + span, length - span)
        return segment, offset


    def _close_idle(self, want: int) -> None:
        """Closes wholly free writable segments until ``want`` bytes are freed (sealed ones
        stay: they cannot be punched, and clients keep them mapped)."""
        for segment in list(self.segments.values()):
            if want <= 0:
                return
            if segment.writable and segment.idle():
                del self.segments[segment.id]
                self.total_bytes -= segment.size
                want -= segment.size
                segment.close()


def _punch(fd: int, size: int) -> None:
    """Releases a memfd's pages (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)."""
    if _libc.fallocate(fd, 3, ctypes.c_long(0), ctypes.c_long(size)) != 0:
        raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE)")


def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _insert_free(free: list[tuple[int, int]], offset: int, length: int) -> None:
    """Returns a range to a free list (sorted by offset), merged with its neighbours."""
    lo, hi = 0, len(free)
    while lo < hi:
        mid = (lo + hi) // 2
        if free[mid][0] < offset:
            lo = mid + 1
        else:
            hi = mid
    if lo < len(free) and offset + length == free[lo][0]:
        length += free[lo][1]
        del free[lo]
    if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == offset:
        offset, length = free[lo - 1][0], free[lo - 1][1] + length
        lo -= 1
        del free[lo]
    free.insert(lo, (offset, length))
