"""The same-node transport's copy-and-checksum (``kvtier.proto.localwire.copy_checked``).

All implementations, the C helper's two (``kvtier.proto._copyhash``, which scripts/setup
builds: ``copy_checked``, and ``copy_streamed`` with its non-temporal stores) and the
pure-Python one, copy the same bytes and return xxh3-64 of them, at every
alignment of the two ends (the C helper exists for the misaligned ones), for values that
span several of their blocks, for several sources, and refuse what cannot be copied whole.
``read_checked`` (a same-node client reading a disk-tier record file: pread and hash in one
pass) likewise, both implementations, and ``write_checked`` (the disk tier writing a value
from a same-node client's staging segment: copied aside, hashed and written in one pass).
"""

from __future__ import annotations

import mmap
import os
import platform
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from kvtier.proto import _copyhash, localwire

IMPLEMENTATIONS: dict[str, Callable[..., int]] = {
    "c": _copyhash.copy_checked,
    "c-streamed": _copyhash.copy_streamed,
    "python": localwire.copy_checked_py,
}
C_COPIES = [_copyhash.copy_checked, _copyhash.copy_streamed]


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def copy(request: pytest.FixtureRequest) -> Callable[..., int]:
    return IMPLEMENTATIONS[request.param]


def test_localwire_uses_the_c_helper_when_it_is_built() -> None:
    assert localwire._copyhash is _copyhash


@pytest.mark.parametrize("src_offset", [0, 1, 16, 48, 63])
@pytest.mark.parametrize("dst_offset", [0, 16, 32, 4095])
def test_exact_bytes_and_checksum_at_every_alignment(
    copy: Callable[..., int], src_offset: int, dst_offset: int
) -> None:
    n = 3 * localwire.BLOCK + 12_345  # several blocks of either implementation, and a tail
    data = os.urandom(n + 64)
    with mmap.mmap(-1, n + 8192) as src_map, mmap.mmap(-1, n + 8192) as dst_map:
        src_map[src_offset : src_offset + n] = data[:n]
        src = memoryview(src_map)[src_offset : src_offset + n]
        dst = memoryview(dst_map)[dst_offset : dst_offset + n]
        assert copy(dst, src) == xxhash.xxh3_64_intdigest(data[:n])
        assert bytes(dst) == data[:n]
        assert dst_map[:dst_offset] == b"\0" * dst_offset  # nothing written outside dst
        assert dst_map[dst_offset + n : dst_offset + n + 64] == b"\0" * 64
        del src, dst


def test_short_values_at_every_destination_offset(copy: Callable[..., int]) -> None:
    """Values shorter than a vector store, and ends that are not multiples of one: the
    streamed copy's unaligned head and tail."""
    data = os.urandom(200)
    for dst_offset in range(18):
        for n in (*range(0, 70), 127, 128, 129, 200 - 18):
            dst = bytearray(b"\xaa" * 240)
            view = memoryview(dst)[dst_offset : dst_offset + n]
            assert copy(view, memoryview(data)[:n]) == xxhash.xxh3_64_intdigest(data[:n])
            assert dst[dst_offset : dst_offset + n] == data[:n]
            assert dst[:dst_offset] == b"\xaa" * dst_offset
            assert dst[dst_offset + n :] == b"\xaa" * (240 - dst_offset - n)
            del view


def test_the_one_pass_copy_is_xxh3_at_every_length_class(copy: Callable[..., int]) -> None:
    """Where the C helper copies and hashes in one pass (x86-64 with AVX2: its own XXH3 of
    long inputs, not libxxhash's), every length around XXH3's edges (240: short inputs end;
    64-byte stripes; 1 KiB blocks, after which the accumulators are scrambled) gives
    libxxhash's digest, from one source and from the same bytes cut at random places into
    several (stripes that span two sources, empty sources)."""
    rng = random.Random(11)
    data = os.urandom(3 * 1024 + 200)
    lengths = sorted(
        {n for edge in (0, 64, 240, 1024, 2048, 3 * 1024) for n in range(edge - 3, edge + 70) if n >= 0}
        | {rng.randrange(241, len(data)) for _ in range(40)}
    )
    for n in lengths:
        value = data[:n]
        want = xxhash.xxh3_64_intdigest(value)
        cuts = sorted(rng.randrange(0, n + 1) for _ in range(rng.randrange(1, 6)))
        for parts in ([value], [value[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]):
            for dst_offset in (0, 1, 32):
                dst = bytearray(n + dst_offset)
                view = memoryview(dst)[dst_offset:]
                assert copy(view, *map(memoryview, parts)) == want, (n, len(parts), dst_offset)
                assert dst[dst_offset:] == value
                del view


def test_the_c_helper_copies_in_one_pass_where_the_cpu_has_avx2() -> None:
    """On x86-64 with AVX2 (this machine) the C helper copies and hashes in one pass, and
    the tests above check that path; the two-pass path, which other CPUs take, is checked
    below with the one-pass copy switched off (``KVTIER_COPY_NO_FUSED``)."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    avx2 = platform.machine() == "x86_64" and "avx2" in cpuinfo.split()
    expected = avx2 and os.environ.get("KVTIER_COPY_NO_FUSED", "") in ("", "0")
    assert bool(_copyhash.FUSED) is expected


def test_the_one_pass_copy_of_large_values_and_many_small_sources(copy: Callable[..., int]) -> None:
    """Values of a few MiB (thousands of blocks), and the most sources a call takes, many of
    them empty or a byte long, so that stripes span several sources at once."""
    rng = random.Random(5)
    data = os.urandom((4 << 20) + 1)
    for n in (1 << 20, (1 << 20) - 1, (4 << 20) + 1):
        dst = bytearray(n)
        assert copy(memoryview(dst), memoryview(data)[:n]) == xxhash.xxh3_64_intdigest(data[:n])
        assert dst == data[:n]
    for _ in range(20):
        sizes = [rng.choice((0, 0, 1, 1, 2, 63, 65, rng.randrange(0, 5000))) for _ in range(64)]
        parts, at = [], 0
        for size in sizes:
            parts.append(memoryview(data)[at : at + size])
            at += size
        dst = bytearray(at)
        assert copy(memoryview(dst), *parts) == xxhash.xxh3_64_intdigest(data[:at]), sizes
        assert dst == data[:at]


def test_the_two_pass_copy_gives_the_same_bytes_and_checksums() -> None:
    """The path a CPU without AVX2 takes, run here by switching the one-pass copy off."""
    script = (
        "import os, random, xxhash\n"
        "from kvtier.proto import _copyhash as c\n"
        "assert c.FUSED == 0\n"
        "data = os.urandom(300_000)\n"
        "for n in (0, 240, 241, 1024, 1025, 70_000, 300_000):\n"
        "    for f in (c.copy_checked, c.copy_streamed):\n"
        "        dst = bytearray(n + 1)\n"
        "        got = f(memoryview(dst)[1:], data[: n // 3], data[n // 3 : n])\n"
        "        assert got == xxhash.xxh3_64_intdigest(data[:n]) and dst[1:] == data[:n], n\n"
        "print('ok')\n"
    )
    env = {**os.environ, "KVTIER_COPY_NO_FUSED": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_several_sources_land_back_to_back(copy: Callable[..., int]) -> None:
    rng = random.Random(7)
    parts = [rng.randbytes(size) for size in (0, 1, 37, 70_000, localwire.BLOCK + 5, 3)]
    whole = b"".join(parts)
    dst = bytearray(len(whole))
    assert copy(memoryview(dst), *map(memoryview, parts)) == xxhash.xxh3_64_intdigest(whole)
    assert dst == whole


def test_an_empty_value_has_the_empty_checksum(copy: Callable[..., int]) -> None:
    assert copy(memoryview(bytearray())) == xxhash.xxh3_64_intdigest(b"")
    assert copy(memoryview(bytearray()), memoryview(b"")) == xxhash.xxh3_64_intdigest(b"")


def test_a_length_mismatch_is_refused_before_any_byte_is_written(
    copy: Callable[..., int],
) -> None:
    dst = bytearray(b"\xaa" * 10)
    for sources in ([b"x" * 11], [b"x" * 5, b"y" * 4]):
        with pytest.raises(ValueError, match="copy of"):
            copy(memoryview(dst), *map(memoryview, sources))
    assert dst == b"\xaa" * 10


def test_a_read_only_destination_is_refused(copy: Callable[..., int]) -> None:
    with pytest.raises((TypeError, BufferError)):
        copy(memoryview(b"0123"), memoryview(b"abcd"))


@pytest.mark.parametrize("c_copy", C_COPIES, ids=["checked", "streamed"])
def test_the_c_helper_refuses_what_is_not_a_buffer(c_copy: Callable[..., int]) -> None:
    with pytest.raises(TypeError, match="dst is required"):
        c_copy()
    with pytest.raises(TypeError):
        c_copy(bytearray(3), "abc")
    with pytest.raises(ValueError, match="sources"):
        c_copy(bytearray(65), *[b"x"] * 65)


@pytest.mark.parametrize("c_copy", C_COPIES, ids=["checked", "streamed"])
def test_the_c_helper_lets_other_threads_run_during_a_copy(c_copy: Callable[..., int]) -> None:
    """The copy runs without the GIL: a Python thread keeps counting while the main thread
    is inside a copy of 256 MiB. Held, the GIL would let it count only around the call
    (at most a switch interval, set to 1 ms here, against ~25 ms of copying)."""
    chunk = memoryview(os.urandom(4 << 20))
    sources = [chunk] * 64
    dst = memoryview(bytearray(256 << 20))
    c_copy(dst, *sources)  # pages faulted in before anything is measured
    box = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            box[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    thread = threading.Thread(target=count)
    thread.start()
    try:
        shares = []
        for _ in range(3):
            a, t0 = box[0], time.perf_counter()
            time.sleep(0.05)  # the counter alone: its rate
            rate = (box[0] - a) / (time.perf_counter() - t0)
            a, t0 = box[0], time.perf_counter()
            c_copy(dst, *sources)
            shares.append((box[0] - a) / (rate * (time.perf_counter() - t0)))
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)
    assert max(shares) > 0.25, shares


# -- read_checked: a record file read by a same-node client -----------------------------

READERS: dict[str, Callable[..., int]] = {
    "c": _copyhash.read_checked,
    "python": localwire.read_checked_py,
}


@pytest.fixture(params=sorted(READERS))
def read(request: pytest.FixtureRequest) -> Callable[..., int]:
    return READERS[request.param]


@pytest.fixture
def record_file(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    """A file of a 24-byte header, a 37-byte key and a value of several blocks and a tail."""
    data = os.urandom(24 + 37 + 3 * localwire.BLOCK + 4321)
    path = tmp_path / "record"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


@pytest.mark.parametrize("prefix_len", [0, 1, 37])
def test_read_checked_reads_the_value_and_hashes_the_prefix_before_it(
    read: Callable[..., int], record_file: tuple[int, bytes], prefix_len: int
) -> None:
    fd, data = record_file
    start = 24 + 37 - prefix_len  # the prefix ends where the value starts
    value = data[24 + 37 :]
    dst = bytearray(len(value) + 64)
    got = read(fd, start, memoryview(dst)[: len(value)], prefix_len)
    assert got == xxhash.xxh3_64_intdigest(data[start:])
    assert bytes(dst[: len(value)]) == value and dst[len(value) :] == b"\0" * 64


def test_both_readers_agree_on_every_part_of_a_file(record_file: tuple[int, bytes]) -> None:
    fd, data = record_file
    rng = random.Random(3)
    for _ in range(20):
        start = rng.randrange(0, len(data))
        n = rng.randrange(0, len(data) - start)
        prefix = rng.randrange(0, min(n, 65535) + 1)
        a, b = bytearray(n - prefix), bytearray(n - prefix)
        assert _copyhash.read_checked(fd, start, a, prefix) == localwire.read_checked_py(fd, start, memoryview(b), prefix)
        assert a == b == data[start + prefix : start + n]


def test_a_file_that_ends_early_raises_eof(read: Callable[..., int], record_file: tuple[int, bytes]) -> None:
    fd, data = record_file
    with pytest.raises(EOFError):
        read(fd, 10, memoryview(bytearray(len(data))), 0)  # 10 bytes short
    with pytest.raises(EOFError):
        read(fd, len(data) - 5, memoryview(bytearray(1)), 10)  # inside the prefix


def test_a_bad_descriptor_or_argument_is_refused(read: Callable[..., int], record_file: tuple[int, bytes]) -> None:
    fd, _ = record_file
    with pytest.raises(OSError):
        read(10_000, 0, memoryview(bytearray(10)), 0)  # not open
    for bad in ((-1, 0, 0), (fd, -1, 0), (fd, 0, -1), (fd, 0, 65536)):
        with pytest.raises(ValueError):
            read(bad[0], bad[1], memoryview(bytearray(10)), bad[2])
    with pytest.raises(BufferError):
        read(fd, 0, b"read-only", 0)  # the destination must be writable


# -- write_checked: the disk tier writing a value from a same-node client's staging segment --

WRITERS: dict[str, Callable[..., tuple[int, int]]] = {
    "c": _copyhash.write_checked,
    "python": localwire.write_checked_py,
}


@pytest.fixture(params=sorted(WRITERS))
def write(request: pytest.FixtureRequest) -> Callable[..., tuple[int, int]]:
    return WRITERS[request.param]


@pytest.mark.parametrize("size", [0, 1, localwire.BLOCK, 3 * localwire.BLOCK + 4321])
@pytest.mark.parametrize("prefix", [b"", b"k", b"key" * 21845])
def test_write_checked_writes_prefix_then_value_and_returns_both_checksums(
    write: Callable[..., tuple[int, int]], tmp_path: Path, size: int, prefix: bytes
) -> None:
    value = os.urandom(size)
    path = tmp_path / "record"
    path.write_bytes(b"H" * 24)  # what lies before the offset stays
    fd = os.open(path, os.O_WRONLY)
    try:
        got = write(fd, 24, memoryview(bytearray(value)), prefix)
    finally:
        os.close(fd)
    assert got == (xxhash.xxh3_64_intdigest(value), xxhash.xxh3_64_intdigest(prefix + value))
    assert path.read_bytes() == b"H" * 24 + prefix + value


def test_write_checked_from_a_shared_mapping_at_an_odd_offset(
    write: Callable[..., tuple[int, int]], tmp_path: Path
) -> None:
    staging = mmap.mmap(-1, 2 * localwire.BLOCK + 100)
    staging[:] = os.urandom(len(staging))
    part = memoryview(staging)[7 : 7 + localwire.BLOCK + 50]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        got = write(fd, 0, part, b"")
    finally:
        os.close(fd)
        expected = bytes(part)
        part.release()
        staging.close()
    assert got[0] == got[1] == xxhash.xxh3_64_intdigest(expected)
    assert (tmp_path / "f").read_bytes() == expected


def test_write_checked_refuses_a_bad_descriptor_or_argument(
    write: Callable[..., tuple[int, int]], tmp_path: Path
) -> None:
    with pytest.raises(OSError):
        write(10_000, 0, b"value", b"k")  # not open
    path = tmp_path / "ro"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError):
            write(fd, 0, b"value", b"k")  # not open for writing
        for bad in ((-1, 0, b""), (fd, -1, b""), (fd, 0, b"k" * 65536)):
            with pytest.raises(ValueError):
                write(bad[0], bad[1], b"value", bad[2])
    finally:
        os.close(fd)
    assert path.read_bytes() == b""
