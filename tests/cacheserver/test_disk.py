"""The disk tier on a real directory."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

from kvtier.cacheserver import disk, record
from kvtier.cacheserver.disk import DiskTier, _Retirer, can_swap_names, exchange
from kvtier.cacheserver.errors import ChecksumMismatch, TierFailure
from kvtier.proto import localwire


async def opened(directory: Path, capacity: int = 10 << 20) -> DiskTier:
    tier = DiskTier(directory, capacity)
    await tier.open()
    return tier


def files(directory: Path) -> list[Path]:
    return sorted(p for p in (directory / "v1").rglob("*") if p.is_file())


async def test_a_value_written_is_read_back_and_survives_reopening(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    assert await tier.put(b"k", b"value" * 1000)
    again = await opened(tmp_path)
    assert again.usage().entries == 1
    got = await again.get(b"k")
    assert got is not None and bytes(got) == b"value" * 1000


async def test_eviction_keeps_the_tier_within_its_capacity(tmp_path: Path) -> None:
    tier = await opened(tmp_path, capacity=300_000)
    for i in range(10):
        assert await tier.put(b"k%d" % i, os.urandom(50_000))
    assert tier.usage().used_bytes <= 300_000
    assert tier.counters.evictions >= 4
    assert sum(p.stat().st_size for p in files(tmp_path)) == tier.usage().used_bytes
    assert await tier.get(b"k0") is None and await tier.get(b"k9") is not None


async def test_a_value_larger_than_the_capacity_is_refused(tmp_path: Path) -> None:
    tier = await opened(tmp_path, capacity=1000)
    assert not await tier.put(b"big", b"x" * 2000)
    assert files(tmp_path) == []


async def test_swapped_files_are_detected_deleted_and_counted(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    await tier.put(b"a", b"A" * 100)
    await tier.put(b"b", b"B" * 100)
    pa, pb = tier._path(b"a"), tier._path(b"b")
    tmp = pa.with_suffix(".swap")
    os.replace(pa, tmp)
    os.replace(pb, pa)
    os.replace(tmp, pb)
    assert await tier.get(b"a") is None
    assert await tier.get(b"b") is None
    assert tier.counters.verification_failures == 2
    assert files(tmp_path) == []


async def test_a_half_written_temporary_file_is_never_visible_and_is_cleaned_at_start(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    (tmp_path / "tmp" / "leftover.1234").write_bytes(record.encode(b"\x07default" + b"x", b"partial")[:10])
    again = await opened(tmp_path)
    assert again.usage().entries == 0
    assert list((tmp_path / "tmp").iterdir()) == []
    assert tier.usage().entries == 0


async def test_a_broken_directory_raises_tier_failure_and_ping_reports_it(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    shutil.rmtree(tmp_path / "tmp")
    (tmp_path / "tmp").write_text("not a directory")  # writes now fail, even as root
    with pytest.raises(TierFailure, match="disk tier: write failed"):
        await tier.put(b"k", b"v")
    with pytest.raises(TierFailure, match="not writable"):
        await tier.ping()
    assert tier.usage().used_bytes == 0, "a failed write releases its reserved space"


async def test_a_get_reuses_a_read_buffer_only_once_no_value_of_it_is_held(tmp_path: Path) -> None:
    """Records are read into buffers kept for reuse: a value still held (being sent,
    promoted) keeps its buffer, so reading other values never changes its bytes; once
    it is dropped, the next read of that size lands in the same memory."""
    tier = await opened(tmp_path, 64 << 20)
    values = {f"k{i}".encode(): os.urandom(2 << 20) for i in range(4)}
    for key, value in values.items():
        assert await tier.put(key, value)
    held = {key: await tier.get(key) for key in values}  # every buffer in use
    for key, got in held.items():
        assert got is not None and got.readonly and bytes(got) == values[key]
    assert tier._read_buffers.reused == 0
    rotated = [*values][1:] + [*values][:1]  # a wrong reuse would overwrite another's bytes
    for key in rotated:  # read again while the first reads are held: new buffers
        again = await tier.get(key)
        assert again is not None and bytes(again) == values[key]
        del again
    for key, got in held.items():
        assert got is not None and bytes(got) == values[key]
    first = held[b"k0"]
    assert first is not None
    buffer = first.obj
    del first
    held.clear()  # every value dropped: their buffers may be read into again
    reused = await tier.get(b"k3")
    assert reused is not None and bytes(reused) == values[b"k3"]
    assert tier._read_buffers.reused >= 1
    assert any(reused.obj is b for b in tier._read_buffers._kept)
    del buffer


async def test_read_buffers_stay_within_their_bound(tmp_path: Path) -> None:
    tier = await opened(tmp_path, 64 << 20)
    tier._read_buffers.limit = 5 << 20
    for i in range(6):
        assert await tier.put(f"k{i}".encode(), bytes([i]) * (2 << 20))
    held = [await tier.get(f"k{i}".encode()) for i in range(6)]
    assert sum(map(len, tier._read_buffers._kept)) <= 5 << 20
    assert [bytes(v[:1]) for v in held if v is not None] == [bytes([i]) for i in range(6)]


def descriptors_of_removed_files(directory: Path) -> list[str]:
    """This process's open descriptors of files under ``directory`` that have no name any
    more (a record renamed over or unlinked, its space still held)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(directory)) and target.endswith(" (deleted)"):
                found.append(target)
    return found


async def test_records_replaced_deleted_or_evicted_go_at_once_and_their_space_by_close(
    tmp_path: Path,
) -> None:
    """A record a write replaced, or a delete or an eviction removed, is freed behind the
    writes (``_Retirer``): its name goes at once (a Get, a restart see only the new state),
    its space within ``RETIRE_BYTES``, and all of it by ``close``."""
    tier = await opened(tmp_path, capacity=8 << 20)
    tier._retirer.limit = 3 << 20
    for round_ in range(6):  # every key replaced five times
        for i in range(4):
            assert await tier.put(b"k%d" % i, bytes([round_]) * (1 << 20))
        assert tier._retirer.pending <= 3 << 20
    assert [bytes((await tier.get(b"k%d" % i) or b"")[:1]) for i in range(4)] == [b"\x05"] * 4
    assert await tier.delete([b"k0"]) == 1
    assert await tier.get(b"k0") is None
    for i in range(8):  # 8 MiB of new keys: evicts k1-k3 and the first of these
        assert await tier.put(b"new%d" % i, bytes([i]) * (1 << 20) + b"x")
    assert await tier.get(b"k1") is None
    assert len(files(tmp_path)) == tier.usage().entries == 7
    assert sum(p.stat().st_size for p in files(tmp_path)) == tier.usage().used_bytes
    assert tier._retirer.pending <= 3 << 20

    await tier.close()
    assert tier._retirer.pending == 0
    assert descriptors_of_removed_files(tmp_path) == []
    again = await opened(tmp_path)  # a restart finds exactly the live records
    assert again.usage().entries == 7
    got = await again.get(b"new7")
    assert got is not None and bytes(got) == bytes([7]) * (1 << 20) + b"x"


def test_retired_records_wait_within_their_bound_beyond_it_and_after_close_go_at_once(
    tmp_path: Path,
) -> None:
    retirer = _Retirer(limit=0)
    paths = []
    for i in range(3):
        path = tmp_path / f"f{i}"
        path.write_bytes(b"x" * 4096)
        paths.append(path)

    held = retirer.hold(paths[0])
    assert held is not None and retirer.hold(tmp_path / "none") is None
    paths[0].unlink()
    assert len(descriptors_of_removed_files(tmp_path)) == 1  # unlinked, still held
    retirer.retire(held)  # 4 KiB over a bound of 0: closed here, no thread started
    assert retirer.pending == 0 and retirer._thread is None
    assert descriptors_of_removed_files(tmp_path) == []

    retirer.limit = 1 << 20
    for path in paths[1:]:
        fd = retirer.hold(path)
        assert fd is not None
        path.unlink()
        retirer.retire(fd)
        assert retirer.pending <= 1 << 20
    retirer.drain()
    assert retirer.pending == 0 and descriptors_of_removed_files(tmp_path) == []

    retirer.close()
    late = tmp_path / "late"
    late.write_bytes(b"y")
    fd = retirer.hold(late)
    assert fd is not None
    late.unlink()
    retirer.retire(fd)  # closed: at once
    assert descriptors_of_removed_files(tmp_path) == []


# -- open_record: a same-node client reads the record file itself ----------------------


def evict_from_page_cache(path: Path) -> None:
    """Drops the file's pages from the page cache (clean pages only: written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_record(opened: record.RecordFile) -> tuple[bytes, bytes]:
    key = os.pread(opened.fd, opened.key_len, record.HEADER_SIZE)
    value = os.pread(opened.fd, opened.value_len, record.HEADER_SIZE + opened.key_len)
    assert record.checksum(key, value) == opened.checksum
    return key, value


@pytest.mark.parametrize("path", ["on the event loop", "in a thread"])
async def test_open_record_hands_over_the_record_file_with_its_header_checked(
    tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = await opened(tmp_path)
    value = os.urandom(3 << 20)
    assert await tier.put(b"k", value)
    (file,) = files(tmp_path)
    opens: list[Path] = []
    if path == "in a thread":  # as when the header is not in the page cache
        monkeypatch.setattr(record, "open_file_nowait", lambda *_: None)
        blocking = record.open_file
        monkeypatch.setattr(record, "open_file", lambda p, k: (opens.append(Path(p)), blocking(p, k))[1])
    else:
        probe = record.open_file_nowait(file, b"k")
        if probe is None:
            pytest.skip("no openat2(RESOLVE_CACHED) or RWF_NOWAIT reads on this kernel and file system")
        probe.close()
    got = await tier.open_record(b"k")
    assert got is not None
    try:
        assert read_record(got) == (b"k", value) and got.nbytes == len(value)
    finally:
        got.close()
    assert opens == ([file] if path == "in a thread" else [])
    assert tier.counters.hits == 1 and await tier.open_record(b"absent") is None


async def test_a_record_whose_header_is_not_in_the_page_cache_is_not_opened_on_the_event_loop(
    tmp_path: Path,
) -> None:
    tier = await opened(tmp_path)
    await tier.put(b"k", os.urandom(1 << 20))
    (file,) = files(tmp_path)
    evict_from_page_cache(file)
    assert record.open_file_nowait(file, b"k") is None  # it would wait for the disk


async def test_open_record_out_of_descriptors_is_a_miss_not_a_failed_tier(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    await tier.put(b"k", os.urandom(1 << 20))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        assert await tier.open_record(b"k") is None
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert tier.counters.misses == 1 and b"k" in tier.lru  # still indexed: served once it can be
    got = await tier.open_record(b"k")
    assert got is not None
    got.close()


async def test_open_record_of_a_file_replaced_meanwhile_still_reads_the_old_record(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    old, new = os.urandom(1 << 20), os.urandom(1 << 20)
    await tier.put(b"k", old)
    got = await tier.open_record(b"k")
    assert got is not None
    await tier.put(b"k", new)  # written aside, renamed over the old file
    await tier.delete([b"k"])
    try:
        assert read_record(got) == (b"k", old)
    finally:
        got.close()


def needs_swapping(directory: Path) -> None:
    """Skips a test of the swap of names where ``directory``'s file system cannot swap (a
    platform fact: NFS, FUSE, an older overlayfs; ext4 and tmpfs can)."""
    if not can_swap_names(directory):
        pytest.skip("this file system cannot swap names (renameat2 RENAME_EXCHANGE)")


def failing_with(err: int) -> Callable[[Path, Path], None]:
    """A ``Swaps.before`` that fails as renameat2 would with ``err``."""

    def fail(_tmp: Path, final: Path) -> None:
        raise OSError(err, os.strerror(err), str(final))

    return fail


class Swaps:
    """A spy on ``disk.exchange`` (the real one runs): counts the names it swapped; ``before``
    runs first, as a racing Delete or a file system that cannot would."""

    def __init__(self, before: Callable[[Path, Path], None] | None = None) -> None:
        self.real, self.before = exchange, before
        self.calls = self.swapped = 0

    def __call__(self, tmp: Path, final: Path) -> bool:
        self.calls += 1
        if self.before is not None:
            self.before(tmp, final)
        done = self.real(tmp, final)
        self.swapped += done
        return done


@pytest.mark.parametrize("swap", [True, False], ids=["names swapped", "renamed over"])
async def test_a_record_replaced_under_readers_is_always_whole_and_leaves_nothing_behind(
    tmp_path: Path, swap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record replacing one of its key takes its place by a swap of names (``renameat2``
    ``RENAME_EXCHANGE``: no ext4 flush on the write's path) or, where the file system
    cannot, a rename over it: a reader opening the key's file meanwhile always finds a
    whole record of one of the values written, and neither way leaves a file in ``tmp/``
    or a descriptor of a removed record once the tier is closed."""
    if swap:
        needs_swapping(tmp_path)
    tier = await opened(tmp_path, capacity=64 << 20)
    assert tier.swaps  # found able to at start-up
    tier.swaps = swap
    swaps = Swaps()
    monkeypatch.setattr(disk, "exchange", swaps)
    values = [bytes([i]) * (1 << 20) + os.urandom(64) for i in range(40)]
    assert await tier.put(b"k", values[0])
    final = tier._path(b"k")
    seen: set[bytes] = set()
    failures: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                with open(final, "rb") as f:
                    data = f.read()
                seen.add(bytes(record.decode(b"k", data)))
            except (OSError, record.CorruptRecord) as exc:
                failures.append(repr(exc))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for value in values[1:]:
            assert await tier.put(b"k", value)
    finally:
        stop.set()
        reader.join(30)
    assert failures == [], failures[:3]
    assert seen and seen <= set(values)
    assert swaps.swapped == (39 if swap else 0)  # every replacement went the way named
    got = await tier.get(b"k")
    assert got is not None and bytes(got) == values[-1]
    assert list((tmp_path / "tmp").iterdir()) == []
    assert len(files(tmp_path)) == tier.usage().entries == 1
    await tier.close()
    assert descriptors_of_removed_files(tmp_path) == []


async def test_a_record_deleted_just_before_the_swap_is_renamed_into_place_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old record's name gone between the write and the swap (a Delete or an eviction
    unlinking it): ``exchange`` declines, the new record is renamed into place, and the tier
    keeps swapping names afterwards."""
    needs_swapping(tmp_path)
    tier = await opened(tmp_path)
    assert await tier.put(b"k", b"old" * 1000)
    racing = Swaps(before=lambda _tmp, final: final.unlink())
    monkeypatch.setattr(disk, "exchange", racing)
    assert await tier.put(b"k", b"new" * 1000)
    assert (racing.calls, racing.swapped) == (1, 0)
    got = await tier.get(b"k")
    assert got is not None and bytes(got) == b"new" * 1000
    assert list((tmp_path / "tmp").iterdir()) == [] and len(files(tmp_path)) == 1
    assert tier.swaps
    monkeypatch.setattr(disk, "exchange", later := Swaps())
    assert await tier.put(b"k", b"newer" * 1000)
    assert later.swapped == 1


@pytest.mark.parametrize(
    ("err", "unsupported"), [(errno.EINVAL, True), (errno.EOPNOTSUPP, True), (errno.EPERM, False)]
)
async def test_a_file_system_that_cannot_swap_names_turns_the_swap_off_for_its_tier_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, unsupported: bool
) -> None:
    """An error that says the file system cannot swap names (EINVAL, EOPNOTSUPP: an older
    overlayfs, NFS, FUSE) makes that tier rename instead from then on, the write stored;
    another tier keeps swapping. An error of one file (EPERM: an immutable record) fails
    that write only, as a rename over it would."""
    needs_swapping(tmp_path)
    tier = await opened(tmp_path / "one")
    other = await opened(tmp_path / "two")
    for t in (tier, other):
        assert await t.put(b"k", b"old" * 1000)

    refusing = Swaps(before=failing_with(err))
    monkeypatch.setattr(disk, "exchange", refusing)
    if unsupported:
        assert await tier.put(b"k", b"new" * 1000)
        got = await tier.get(b"k")
        assert got is not None and bytes(got) == b"new" * 1000
        assert not tier.swaps
        assert await tier.put(b"k", b"newer" * 1000)
        assert refusing.calls == 1  # not tried again on this tier
    else:
        with pytest.raises(TierFailure):
            await tier.put(b"k", b"new" * 1000)
        assert tier.swaps
    assert list((tmp_path / "one" / "tmp").iterdir()) == []
    monkeypatch.setattr(disk, "exchange", swapping := Swaps())
    assert await other.put(b"k", b"new" * 1000)
    assert other.swaps and swapping.swapped == 1


async def test_a_tier_whose_file_system_cannot_swap_names_finds_out_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk, "exchange", refusing := Swaps(before=failing_with(errno.EINVAL)))
    tier = await opened(tmp_path)
    assert not tier.swaps and refusing.calls == 1
    for value in (b"old", b"new"):
        assert await tier.put(b"k", value * 1000)
    got = await tier.get(b"k")
    assert got is not None and bytes(got) == b"new" * 1000
    assert refusing.calls == 1 and list((tmp_path / "tmp").iterdir()) == []


async def test_a_tier_whose_probe_cannot_write_still_opens_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up probe failing for another reason than the file system's (a ``tmp/`` not
    writable now) does not stop the tier from opening: its writes and ``ping`` say so."""
    monkeypatch.setattr(disk, "exchange", Swaps(before=failing_with(errno.EROFS)))
    tier = await opened(tmp_path)
    assert tier.swaps and list((tmp_path / "tmp").iterdir()) == []


def test_exchange_swaps_two_names_and_declines_a_missing_target(tmp_path: Path) -> None:
    needs_swapping(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"A")
    b.write_bytes(b"B")
    assert disk.exchange(a, b)
    assert (a.read_bytes(), b.read_bytes()) == (b"B", b"A")
    assert not disk.exchange(a, tmp_path / "missing")  # a Delete got there first
    assert a.read_bytes() == b"B" and not (tmp_path / "missing").exists()


@pytest.mark.parametrize("damage", ["another key's record", "a truncated file", "bad magic"])
async def test_open_record_of_a_bad_header_is_a_miss_deleted_and_counted(tmp_path: Path, damage: str) -> None:
    tier = await opened(tmp_path)
    await tier.put(b"a", os.urandom(4096))
    await tier.put(b"b", os.urandom(4096))
    path_a, path_b = tier._path(b"a"), tier._path(b"b")
    if damage == "another key's record":
        shutil.copyfile(path_b, path_a)
    elif damage == "a truncated file":
        os.truncate(path_a, path_a.stat().st_size - 1)
    else:
        with path_a.open("r+b") as f:
            f.write(b"XXXX")
    assert await tier.open_record(b"a") is None
    assert not path_a.exists() and tier.counters.verification_failures == 1
    got = await tier.open_record(b"b")
    assert got is not None
    got.close()


# -- put_checked: a value written straight from memory its sender can still change --------


async def test_put_checked_writes_the_same_record_as_put(tmp_path: Path) -> None:
    value = os.urandom(3 * (256 << 10) + 17)
    a = await opened(tmp_path / "a")
    b = await opened(tmp_path / "b")
    assert await a.put(b"k", value)
    assert await b.put_checked(b"k", memoryview(bytearray(value)), xxhash.xxh3_64_intdigest(value))
    assert [p.read_bytes() for p in files(tmp_path / "a")] == [p.read_bytes() for p in files(tmp_path / "b")]
    assert stat.S_IMODE(files(tmp_path / "b")[0].stat().st_mode) == 0o400
    got = await b.get(b"k")
    assert got is not None and bytes(got) == value
    assert a.usage() == b.usage()


async def test_put_checked_of_bytes_that_do_not_match_stores_nothing_and_keeps_the_older_value(
    tmp_path: Path,
) -> None:
    tier = await opened(tmp_path)
    assert await tier.put(b"k", b"old" * 1000)
    before = tier.usage()
    new = os.urandom(100_000)
    with pytest.raises(ChecksumMismatch):
        await tier.put_checked(b"k", memoryview(new), xxhash.xxh3_64_intdigest(new) ^ 1)
    with pytest.raises(ChecksumMismatch):
        await tier.put_checked(b"other", memoryview(new), 0)
    assert list((tmp_path / "tmp").iterdir()) == []  # the refused files went
    assert len(files(tmp_path)) == 1 and tier.usage() == before
    got = await tier.get(b"k")
    assert got is not None and bytes(got) == b"old" * 1000
    assert await tier.get(b"other") is None


@pytest.mark.parametrize("meanwhile", ["delete", "evict"])
async def test_a_refused_put_checked_leaves_a_key_deleted_or_evicted_meanwhile_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    tier = await opened(tmp_path, capacity=250_000)
    assert await tier.put(b"k", b"old" * 1000)
    gate, writing = threading.Event(), threading.Event()
    write_checked = localwire.write_checked

    def held(*args: object) -> tuple[int, int]:
        writing.set()
        assert gate.wait(10)
        return write_checked(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(localwire, "write_checked", held)
    new = os.urandom(100_000)
    refused = asyncio.create_task(tier.put_checked(b"k", memoryview(new), 0))
    assert await asyncio.to_thread(writing.wait, 10)
    if meanwhile == "delete":
        deleting = asyncio.create_task(tier.delete([b"k"]))
    else:  # the reservation of k is the oldest entry: a larger put evicts it
        monkeypatch.setattr(localwire, "write_checked", write_checked)
        assert await tier.put(b"big", os.urandom(200_000))
    await asyncio.sleep(0.05)
    gate.set()
    with pytest.raises(ChecksumMismatch):
        await refused
    if meanwhile == "delete":
        assert await deleting == 1
    assert await tier.contains([b"k"]) == [False] and await tier.get(b"k") is None
    assert tier.usage().used_bytes == sum(p.stat().st_size for p in files(tmp_path))
