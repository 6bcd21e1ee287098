"""The disk tier: one file per value on local disk/NVMe, bounded in bytes.

Layout under the configured directory::

    v1/<2 hex>/<64 hex>    records (see ``kvtier.cacheserver.record``), named by
                           sha256 of the namespaced key
    tmp/                   files being written; emptied at start-up

A value is written to ``tmp/`` and renamed into place, so a reader (and a
restarted server) sees a whole record or none. No fsync by default: after a
power loss a renamed file may hold garbage, which the record checksum detects
on read (the entry is deleted and counted, the read is a miss). ``fsync=True``
trades write speed for keeping entries across power loss.

The index (key -> size, in LRU order) lives in memory and is rebuilt at
start-up from the records' headers, so entries survive a restart. Eviction
removes the least recently used files until the new value fits. A key is
indexed when its write starts (its space reserved) and its file appears at the
rename: a Get in between is a miss that keeps the entry, a Delete or eviction
in between makes the write remove its own file once it lands, and writes of
one key go one at a time, so the index and the files never disagree.

A record that replaces one of the same key takes its place by a swap of names
(``renameat2`` with ``RENAME_EXCHANGE``), and the replaced record's new name in ``tmp/``
is removed right after: a reader sees the old record or the new one, as with a rename.
A rename over an existing file would make ext4 (``auto_da_alloc``, on by default) start
writing the new file's data to the device at once, on the write's path, for
applications that replace files without ``fsync``; the tier promises nothing across a
power loss without ``--disk-fsync`` (the checksum catches what is lost), so it leaves
that to the kernel's writeback (docs/benchmarks.md, "Replacing a record without
ext4's flush": file rewrites 2-4x faster in ``kvtier bench replace``, same-node PUTs
of 1 MiB 1.1-1.5x and of 4-64 MiB up to 2.6x, and no device writes for records
replaced before writeback). So without ``--disk-fsync`` a power loss soon after a key
was replaced can lose the key: the new record's data was not written yet (its file is
found empty or wrong at start-up, deleted and counted) and the old one's name is gone.
Where the file system cannot swap names (``EXCHANGE_UNSUPPORTED``: another file
system, an older kernel or C library) the tier renames as before and logs it once.

A full filesystem (ENOSPC) before ``capacity_bytes`` is reached is not a
failure: the tier lowers its capacity to the bytes it holds (logged once per
lowering, shown by ``kvtier_tier_capacity_bytes``), the value is not stored,
and later puts evict the least recently used files to fit under the lowered
capacity. Only a full filesystem holding none of the tier's files is a failure.

File I/O runs in worker threads; the index is only touched from the event loop.

``put_checked`` stores a value straight from memory its sender can still change (a
same-node client's staging segment, ``kvtier.cacheserver.store``): each block is copied
into a private buffer, hashed there and written from there (``localwire.write_checked``),
the header written last with the record's checksum, and the value refused (the file
removed, an older record of the key kept) when it does not match the sender's checksum.

Records a write replaced, and records a delete or an eviction removed, are freed behind
the writes (``_Retirer``): the last reference to a file frees its page cache, about
0.8 ms for a 1 MiB record here, five times the write itself, and the rename or unlink
that drops it would pay that on the write's path. The tier holds the old file open
(an ``O_PATH`` descriptor) across the rename or unlink, which then costs microseconds,
and closes it on a thread of its own. The name is gone at once (a Get or a restart
never sees the old record); only its space comes back later, at most
``RETIRE_BYTES`` behind, and all of it before a write is given up for a full
filesystem (the write is tried again first) and at ``close``.

A Get reads its record into a buffer of ``ReadBuffers`` (``kvtier.cacheserver.readbuffers``,
shared with the Redis tier): one an earlier Get of the same size read into, once nothing
holds that value any more (sent, dropped), else a new one; new memory costs more than
the read itself.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import hashlib
import itertools
import logging
import os
import secrets
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from kvtier.cacheserver import record
from kvtier.cacheserver.errors import ChecksumMismatch, TierFailure
from kvtier.cacheserver.lru import ByteLru
from kvtier.cacheserver.readbuffers import ReadBuffers
from kvtier.cacheserver.tiers import TierCounters, TierUsage
from kvtier.proto import localwire

logger = logging.getLogger(__name__)

_HEAD_READ = record.HEADER_SIZE + 512  # header + the longest namespaced key
RETIRE_BYTES = 64 << 20  # records replaced or removed whose space may come back later, at most

# renameat2(2), for replacing a record by swapping names (``exchange``, ``DiskTier._write``)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc 2.28
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int
# What renameat2 answers where the file system or the kernel cannot swap names (EPERM is
# not one: it comes from one file, an immutable one, as it would for a rename)
EXCHANGE_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})


class _Retirer:
    """Closes, on a thread of its own, descriptors that hold the last reference to records
    renamed over or unlinked, so that freeing their pages happens off the write's path
    (thread-safe: writes and unlinks run in worker threads). At most ``limit`` bytes of
    such records wait; beyond that ``retire`` closes at once, as without it."""

    def __init__(self, limit: int = RETIRE_BYTES) -> None:
        self.limit = limit
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, int]] = deque()  # (descriptor, bytes)
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        """Bytes of records retired and not freed yet."""
        return self._pending

    @staticmethod
    def hold(path: Path) -> int | None:
        """A descriptor of the file at ``path`` (None: there is none) that keeps it, and
        its pages, after its name goes."""
        try:
            return os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None

    def retire(self, fd: int) -> None:
        """Closes ``fd`` (from ``hold``) on the retirer's thread, or here when ``limit``
        bytes wait already or the retirer is closed."""
        try:
            size = os.fstat(fd).st_size
        except OSError:
            size = self.limit + 1
        with self._cond:
            later = not self._closed and self._pending + size <= self.limit
            if later:
                self._queue.append((fd, size))
                self._pending += size
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="kvtier-disk-retire", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
        if not later:
            os.close(fd)

    def drain(self) -> None:
        """Blocks until every record retired so far is freed."""
        with self._cond:
            while self._pending:
                self._cond.wait()

    def close(self) -> None:
        """Frees every record retired (``drain``); later ones are closed at once."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                fd, size = self._queue.popleft()
            try:
                os.close(fd)
            finally:
                with self._cond:
                    self._pending -= size
                    self._cond.notify_all()


class DiskTier:
    name = "disk"

    def __init__(
        self, directory: Path, capacity_bytes: int, *, fsync: bool = False, tenant_quota_bytes: int = 0
    ) -> None:
        self.directory = directory
        self.fsync = fsync
        self.counters = TierCounters()
        self.lru = ByteLru(capacity_bytes, tenant_quota_bytes)  # the index: key -> record size
        self._root = directory / "v1"
        self._root_str = str(self._root)
        self._tmp = directory / "tmp"
        # A record replacing one of its key swaps names with it (``exchange``); off once this
        # tier's file system says it cannot.
        self.swaps = sys.platform == "linux"
        # Keys whose file is being written (indexed already, renamed into place at the end).
        self._writing: dict[bytes, asyncio.Task[bool]] = {}
        self._writes_done = 0
        # Temporary files' suffixes: the process and a counter (the tmp directory is emptied
        # at start-up), not a random token (4% of a 1 MiB PUT's CPU).
        self._tmp_seq = itertools.count()
        self._tmp_pid = os.getpid()
        self._read_buffers = ReadBuffers()
        self._retirer = _Retirer()

    # -- start-up -----------------------------------------------------------------

    async def open(self) -> None:
        """Creates the layout and rebuilds the index from the records on disk."""
        try:
            entries = await asyncio.to_thread(self._scan)
        except OSError as exc:
            raise TierFailure("disk", f"cannot open {self.directory}: {exc.strerror}") from exc
        victims = [v for key, size in entries for v in self.lru.admit(key, size)]
        await self._unlink_evicted(victims)
        logger.info(
            "disk tier at %s: %d entries, %d bytes recovered", self.directory, len(self.lru), self.lru.used
        )

    def _scan(self) -> list[tuple[bytes, int]]:
        self._root.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        for leftover in self._tmp.iterdir():
            leftover.unlink(missing_ok=True)
        try:
            if self.swaps and not can_swap_names(self._tmp):
                self._cannot_swap("tried at start-up")
        except OSError:
            pass  # tmp/ not writable now: as before, the writes say so (and ping)
        found: list[tuple[float, bytes, int]] = []
        for sub in self._root.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                try:
                    st = path.stat()
                    with path.open("rb") as f:
                        key, value_len, _ = record.parse_header(f.read(_HEAD_READ))
                    if path.name != _file_name(key) or st.st_size != (
                        record.HEADER_SIZE + len(key) + value_len
                    ):
                        raise record.CorruptRecord("name or size does not match the header")
                except (OSError, record.CorruptRecord):
                    path.unlink(missing_ok=True)
                    self.counters.verification_failures += 1
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort()  # oldest first: LRU order approximated by modification time
        return [(key, size) for _, key, size in found]

    # -- the Tier protocol ---------------------------------------------------------

    async def get(self, key: bytes) -> memoryview | None:
        if key not in self.lru:
            self.counters.miss(key)
            return None
        path = self._file(key)
        writes = self._writes_done
        try:
            # The record comes back through ``read``, not as the future's result: an
            # executor's future keeps its result alive until a garbage collection, and a
            # read buffer is reused only once nothing references it.
            read: list[memoryview] = []
            await asyncio.to_thread(_read_file, path, self._read_buffers, read)
            blob = read.pop()
            value = record.decode(key, blob)
        except FileNotFoundError:
            self._vanished(key, writes)
            return None
        except OSError as exc:
            raise TierFailure("disk", f"read failed: {exc.strerror}") from exc
        except record.CorruptRecord as exc:
            await self._corrupt(key, exc)
            return None
        self.lru.touch(key)
        self.counters.hit(key)
        return value

    async def open_record(self, key: bytes) -> record.RecordFile | None:
        """``get`` for a same-node client that reads the record itself: the record's file
        opened read-only, its header checked, its value not read (the caller closes it).
        A miss, not a failure of the tier, when the process can open no more files."""
        if key not in self.lru:
            self.counters.miss(key)
            return None
        path = self._file(key)
        writes = self._writes_done
        try:
            opened = record.open_file_nowait(path, key)  # here when that needs no I/O
            if opened is None:
                opening = asyncio.ensure_future(asyncio.to_thread(record.open_file, path, key))
                try:
                    opened = await asyncio.shield(opening)  # cancelled (a deadline): closed once open
                except asyncio.CancelledError:
                    opening.add_done_callback(_close_opened)
                    raise
        except FileNotFoundError:
            self._vanished(key, writes)
            return None
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # out of descriptors: no fault of the disk
                logger.warning("disk tier: no descriptor for a record file (%s); a miss", exc.strerror)
                self.counters.miss(key)
                return None
            raise TierFailure("disk", f"open failed: {exc.strerror}") from exc
        except record.CorruptRecord as exc:
            await self._corrupt(key, exc)
            return None
        self.lru.touch(key)
        self.counters.hit(key)
        return opened

    def _vanished(self, key: bytes, writes: int) -> None:
        """A Get found no file: gone, unless its write is on its way or landed meanwhile."""
        if key not in self._writing and writes == self._writes_done:
            self.lru.remove(key)
        self.counters.miss(key)

    async def _corrupt(self, key: bytes, exc: record.CorruptRecord) -> None:
        logger.warning("disk tier: dropping a corrupt record (%s)", exc)
        self.counters.verification_failures += 1
        self.counters.miss(key)
        await self.delete([key])

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self.lru for k in keys]

    async def put(self, key: bytes, value: bytes | memoryview) -> bool:
        head = record.header(key, value)
        size = len(head) + memoryview(value).nbytes
        return await self._put(key, size, partial(_write_all_of, head, value))

    async def put_checked(self, key: bytes, source: memoryview, checksum: int) -> bool:
        """``put`` straight from ``source``, memory its sender can still change (a same-node
        client's staging segment): each block is copied aside, hashed there (for ``checksum``
        and for the record's) and written from there, one pass instead of a copy into the
        tier's memory, a hash and a write. ``ChecksumMismatch`` when what was written does
        not match ``checksum``: the file is removed and an older record of ``key`` stays."""
        size = record.HEADER_SIZE + len(key) + source.nbytes
        return await self._put(key, size, partial(_write_checked, key, source, checksum))

    async def _put(self, key: bytes, size: int, fill: Callable[[int], None]) -> bool:
        if not self.lru.fits(size):
            return False
        while (prior := self._writing.get(key)) is not None:  # one write of a key at a time
            await asyncio.wait([prior])
        write = asyncio.create_task(self._write_indexed(key, size, fill))
        self._writing[key] = write
        write.add_done_callback(partial(self._written, key))
        # Shielded: a put given up on (its deadline) still finishes its write and its checks.
        return await asyncio.shield(write)

    async def _write_indexed(self, key: bytes, size: int, fill: Callable[[int], None]) -> bool:
        older = self.lru.size_of(key)  # the record this write replaces, if any
        # Admit (reserve the space) before the write, so concurrent puts cannot overshoot.
        await self._unlink_evicted(self.lru.admit(key, size))
        try:
            await self._write_freeing(key, fill)
        except ChecksumMismatch:
            # Refused: the older record was not replaced. It is indexed again only if the key
            # is still ours; deleted or evicted meanwhile, its file is (being) removed.
            if self.lru.remove(key) is not None and older is not None:
                await self._unlink_evicted(self.lru.admit(key, older))
            raise
        except OSError as exc:
            self.lru.remove(key)
            if exc.errno == errno.ENOSPC and self.lru.used > 0:
                self._lower_capacity_to_what_the_filesystem_holds()
                return False
            raise TierFailure("disk", f"write failed: {exc.strerror}") from exc
        if key not in self.lru:  # deleted or evicted while it was written: no file may stay
            await self._unlink_files([key], "delete")
        return True

    async def _write_freeing(self, key: bytes, fill: Callable[[int], None]) -> None:
        """``_write``; on a full filesystem, once more after every record retired so far
        is freed (``_Retirer``: an evicted or replaced record's space may still be held)."""
        try:
            await asyncio.to_thread(self._write, key, fill)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            await asyncio.to_thread(self._retirer.drain)
            await asyncio.to_thread(self._write, key, fill)

    def _written(self, key: bytes, write: asyncio.Task[bool]) -> None:
        self._writes_done += 1
        if self._writing.get(key) is write:
            del self._writing[key]
        if not write.cancelled():
            write.exception()  # retrieved here when the put that waited for it gave up

    def _lower_capacity_to_what_the_filesystem_holds(self) -> None:
        if self.lru.used < self.lru.capacity_bytes:
            logger.warning(
                "disk tier: %s is full at %d bytes of values, below --disk-bytes (%d): "
                "capacity lowered to %d bytes; free space or lower --disk-bytes",
                self.directory,
                self.lru.used,
                self.lru.capacity_bytes,
                self.lru.used,
            )
            self.lru.capacity_bytes = self.lru.used

    async def delete(self, keys: Sequence[bytes]) -> int:
        present = [k for k in keys if self.lru.remove(k) is not None]
        for key in keys:  # a write in progress removes its own file once it sees the key gone
            writing = self._writing.get(key)
            if writing is not None:
                await asyncio.wait([writing])
        if present:
            await self._unlink_files(present, "delete")
        return len(present)

    def usage(self) -> TierUsage:
        return TierUsage(self.lru.used, self.lru.capacity_bytes, len(self.lru))

    def tenant_usage(self, tenant: str) -> TierUsage:
        return self.lru.tenant_usage(tenant)

    def tenant_usages(self) -> dict[str, TierUsage]:
        return self.lru.tenant_usages()

    async def ping(self) -> None:
        """Checks the directory is writable (a probe file written and removed)."""
        probe = self._tmp / f"ping-{secrets.token_hex(4)}"
        try:
            await asyncio.to_thread(_write_and_remove, probe)
        except OSError as exc:
            raise TierFailure("disk", f"{self.directory} is not writable: {exc.strerror}") from exc

    async def close(self) -> None:
        await asyncio.to_thread(self._retirer.close)

    # -- internals ----------------------------------------------------------------

    def _file(self, key: bytes) -> str:
        """The path of ``key``'s record file (a string: building a ``Path`` per Get showed
        in a profile of the tier serving same-node 1 MiB GETs)."""
        name = _file_name(key)
        return f"{self._root_str}/{name[:2]}/{name}"

    def _path(self, key: bytes) -> Path:
        return Path(self._file(key))

    async def _unlink_evicted(self, victims: list[bytes]) -> None:
        if victims:
            self.counters.evicted(victims)
            await self._unlink_files(victims, "eviction")

    async def _unlink_files(self, keys: list[bytes], why: str) -> None:
        try:
            await asyncio.to_thread(self._unlink_many, keys)
        except OSError as exc:
            raise TierFailure("disk", f"{why} failed: {exc.strerror}") from exc

    def _unlink_many(self, keys: list[bytes]) -> None:
        for key in keys:
            path = self._path(key)
            old = self._retirer.hold(path)
            try:
                path.unlink(missing_ok=True)
            finally:
                if old is not None:
                    self._retirer.retire(old)

    def _swapped(self, tmp: Path, final: Path) -> bool:
        """``exchange``, turned off for this tier (``swaps``) when its file system cannot."""
        try:
            return exchange(tmp, final)
        except OSError as exc:
            if exc.errno not in EXCHANGE_UNSUPPORTED:
                raise
            self._cannot_swap(exc.strerror)  # (worker threads may race here: each logs once)
            return False

    def _cannot_swap(self, why: str | None) -> None:
        self.swaps = False
        logger.warning(
            "disk tier at %s: this file system cannot swap names (renameat2 RENAME_EXCHANGE: %s); "
            "a record replaces another by a rename over it, which on ext4 starts writing it to "
            "the device at once",
            self.directory,
            why,
        )

    def _write(self, key: bytes, fill: Callable[[int], None]) -> None:
        final = self._path(key)
        tmp = self._tmp / f"{final.name}.{self._tmp_pid}.{next(self._tmp_seq)}"
        # Read-only to its owner too: the tier never writes a record again (it renames over
        # and unlinks), and a same-node client handed its descriptor cannot open it again
        # writable through /proc unless it is root (docs/security.md).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        try:
            fill(fd)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        old = self._retirer.hold(final)  # the record this one replaces is freed behind
        try:
            if old is not None and self.swaps and self._swapped(tmp, final):
                _unlink_replaced(tmp)  # now the name of the record replaced
            else:
                try:
                    os.replace(tmp, final)
                except FileNotFoundError:
                    # The first record of its directory: directories are made on demand
                    # (a mkdir before every write cost 5% of a 1 MiB PUT's CPU).
                    final.parent.mkdir(exist_ok=True)
                    os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            if old is not None:
                self._retirer.retire(old)


def exchange(tmp: Path, final: Path) -> bool:
    """Swaps the names ``tmp`` and ``final`` (``renameat2`` with ``RENAME_EXCHANGE``: Linux
    3.15 on ext4, glibc 2.28) and returns True; False when ``final`` is gone (a Delete or an
    eviction got there first). ``OSError`` otherwise, with an errno of
    ``EXCHANGE_UNSUPPORTED`` where the file system, the kernel or the C library cannot."""
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not in this C library", str(final))
    if _renameat2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(final), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ENOENT:
        return False
    raise OSError(err, os.strerror(err), str(final))


def can_swap_names(directory: Path) -> bool:
    """Whether ``exchange`` works in ``directory`` (tried on two files made there and removed)."""
    a, b = directory / f".swap-probe-a.{os.getpid()}", directory / f".swap-probe-b.{os.getpid()}"
    a.write_bytes(b"a")
    try:
        b.write_bytes(b"b")
        return exchange(a, b)
    except OSError as exc:
        if exc.errno in EXCHANGE_UNSUPPORTED:
            return False
        raise
    finally:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)


def _unlink_replaced(path: Path) -> None:
    """Removes the name of a record a write replaced (its pages are freed by the retirer).
    The new record is in place already: a failure here is logged, not the write's; the
    file goes with ``tmp/`` at the next start."""
    try:
        os.unlink(path)
    except OSError as exc:
        logger.warning("disk tier: could not remove a replaced record %s: %s", path, exc.strerror)


def _file_name(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()


def _close_opened(opening: asyncio.Future[record.RecordFile]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


def _read_file(path: str, buffers: ReadBuffers, out: list[memoryview]) -> None:
    """Appends to ``out`` the whole record at ``path``, read into a buffer of ``buffers``
    (its first bytes, if the file is shorter than its size said: the record's length
    check catches that)."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = buffers.take(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
        out.append(view[:got].toreadonly())


def _write_all_of(head: bytes, value: bytes | memoryview, fd: int) -> None:
    _write_all(fd, head)
    _write_all(fd, value)


def _write_checked(key: bytes, source: memoryview, checksum: int, fd: int) -> None:
    """Writes a record of ``key`` and ``source``'s bytes (its header last, once the record's
    checksum is known) and checks them against ``checksum`` as written."""
    got, crc = localwire.write_checked(fd, record.HEADER_SIZE, source, key)
    if got != checksum:
        raise ChecksumMismatch(f"the bytes written hash to {got:#x}, not the checksum {checksum:#x} sent")
    localwire.pwrite_all(fd, record.head(key, source.nbytes, crc), 0)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _write_and_remove(path: Path) -> None:
    path.write_bytes(b"ok")
    path.unlink()
