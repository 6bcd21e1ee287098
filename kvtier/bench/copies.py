"""What one in-memory copy costs on this machine: the figures behind the same-node
transport's design (docs/benchmarks.md, "Same-node copies and alignment").

    python -m kvtier.bench.copies [--mib 64] [--repeat 10] [--dir DIR]

Prints GB/s (best of ``--repeat``) of:

- a copy in 256 KiB blocks (``localwire.BLOCK``: the pure-Python ``copy_checked``'s
  memoryview slice assignments) out of a page-aligned memfd segment, at several
  alignments of the two ends (offsets in bytes from a page boundary);
- ``copy_checked``: the C helper (``kvtier.proto._copyhash``) and the pure-Python one,
  at the aligned case and the case of a ``bytearray`` receive buffer (data at 16); the C
  helper copies and hashes in one pass where the CPU has AVX2, in two (a copy, then a hash
  of the copy) elsewhere or with ``KVTIER_COPY_NO_FUSED=1`` in the environment: run it
  both ways to compare;
- a same-node PUT's copy (a value in process memory into a shared segment it writes
  once, rotating over a segment four times the copy): ``copy_checked`` (copy, then hash
  what landed) against ``copy_streamed`` (hash the source, then non-temporal stores);
- a copy into pages touched before against one into pages never touched (a new memfd
  segment, or memory the kernel must first allocate and zero): what a tier pays for a
  value that lands in fresh memory instead of memory it recycled; and ``copy_checked``
  into a new mapping of pages that exist (a same-node client's first write into each
  page of a tier segment it reserved in);
- reading a file from the page cache into a buffer touched before: ``readinto`` (the
  ``plain file`` baseline of ``kvtier bench tier``) against ``read_checked`` (pread and
  xxh3-64 block by block: a same-node client reading a disk-tier record file), C and
  pure Python;
- reading a record back (``pread`` at its value's offset) by how it was written: whole,
  in 256 KiB blocks at the record's unaligned offsets, or by ``write_checked`` (blocks
  ending at multiples of 256 KiB in the file): the page cache keeps an unaligned
  block's partial end pages apart, and reads of such a file are slower.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from functools import partial

from kvtier.proto import localwire

OFFSETS = ((0, 0), (0, 8), (0, 16), (0, 32), (0, 64), (16, 32), (48, 0))


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of ``repeat`` timed calls of ``fn``, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _rate(n: int, fn: Callable[[], object], repeat: int) -> float:
    return n / best_seconds(fn, repeat) / 1e9


def _memfd(n: int) -> mmap.mmap:
    fd = os.memfd_create("kvtier-bench-copies")
    try:
        os.ftruncate(fd, n)
        return mmap.mmap(fd, n)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.bench.copies", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--mib", type=int, default=64, help="bytes per copy, MiB (default 64)")
    parser.add_argument("--repeat", type=int, default=10, help="copies per figure (default 10)")
    parser.add_argument("--dir", default=None, help="where the file read last lives (default: the temp dir)")
    args = parser.parse_args(argv)
    n = args.mib << 20
    block = localwire.BLOCK
    source = _memfd(n + 8192)
    source[: n + 64] = os.urandom(n + 64)
    target = mmap.mmap(-1, n + 8192)
    target[:] = bytes(n + 8192)  # touched: no page faults in what follows

    print(f"{args.mib} MiB, best of {args.repeat}; GB/s")
    print("\nblockwise copy (256 KiB memoryview slice assignments) out of a memfd segment:")
    for src_off, dst_off in OFFSETS:
        src = memoryview(source)[src_off : src_off + n]
        dst = memoryview(target)[dst_off : dst_off + n]

        def blocks(src: memoryview = src, dst: memoryview = dst) -> None:
            for at in range(0, n, block):
                dst[at : at + block] = src[at : at + block]

        print(
            f"  source at {src_off:2d}, destination at {dst_off:2d} (destination - source "
            f"mod 4096: {(dst_off - src_off) % 4096:4d}): {_rate(n, blocks, args.repeat):6.2f}"
        )
        src.release()
        dst.release()

    helper = localwire._copyhash
    passes = "not built" if helper is None else "one pass" if helper.FUSED else "two passes"
    print(f"\ncopy_checked (copy and xxh3-64) out of a memfd segment; the C helper in {passes}:")
    for dst_off in (0, 16):
        src = memoryview(source)[:n]
        dst = memoryview(target)[dst_off : dst_off + n]
        c = (
            f"{_rate(n, partial(helper.copy_checked, dst, src), args.repeat):6.2f}"
            if helper is not None
            else "  (not built)"
        )
        py = _rate(n, partial(localwire.copy_checked_py, dst, src), args.repeat)
        print(f"  destination at {dst_off:2d}: C {c}   pure Python {py:6.2f}")
        src.release()
        dst.release()

    print("\na PUT's copy of a value in process memory into a shared segment (copy and xxh3-64):")
    value = memoryview(bytearray(os.urandom(n)))
    with _memfd(4 * n) as ring:
        ring[:] = bytes(4 * n)  # touched before, as a tier's reserved extents are
        places = [memoryview(ring)[i * n : (i + 1) * n] for i in range(4)]
        turn = [0]

        def rotating(copy: Callable[..., int]) -> None:
            turn[0] += 1
            copy(places[turn[0] % 4], value)

        for name in ("copy_checked", "copy_streamed"):
            rate = (
                f"{_rate(n, partial(rotating, getattr(helper, name)), args.repeat):6.2f}"
                if helper is not None
                else "  (not built)"
            )
            print(f"  {name:13s} C {rate}")
        for place in places:
            place.release()

    print("\nfirst touch: a copy into pages touched before, against fresh ones:")
    payload = memoryview(bytearray(os.urandom(n)))
    warm = memoryview(target)[:n]
    touched = _rate(n, partial(warm.__setitem__, slice(None), payload), args.repeat)
    warm.release()
    fresh_rates = []
    for _ in range(max(1, args.repeat // 2)):
        segment = _memfd(n)
        view = memoryview(segment)
        start = time.perf_counter()
        view[:] = payload
        fresh_rates.append(n / (time.perf_counter() - start) / 1e9)
        view.release()
        segment.close()
    print(f"  into touched memory {touched:6.2f}   into a new memfd {max(fresh_rates):6.2f}")
    # A same-node client's first write into a tier segment's page: the page exists (the
    # tier faulted it in), the client's new mapping of it does not yet.
    fd = os.memfd_create("kvtier-bench-copies")
    try:
        os.ftruncate(fd, n)
        with mmap.mmap(fd, n) as owner:
            owner[:] = bytes(n)
            remapped = []
            for _ in range(max(1, args.repeat // 2)):
                with mmap.mmap(fd, n) as mapping:
                    view = memoryview(mapping)
                    start = time.perf_counter()
                    localwire.copy_checked(view, payload)
                    remapped.append(n / (time.perf_counter() - start) / 1e9)
                    view.release()
    finally:
        os.close(fd)
    print(f"  copy_checked into a new mapping of existing pages {max(remapped):6.2f}")

    print("\na file in the page cache read into memory touched before:")
    with tempfile.NamedTemporaryFile(dir=args.dir) as f:
        f.write(payload)
        f.flush()
        dst = memoryview(target)[:n]

        def readinto() -> None:
            with open(f.name, "rb", buffering=0) as again:
                again.readinto(dst)

        fd = f.fileno()
        c = (
            f"{_rate(n, partial(helper.read_checked, fd, 0, dst, 0), args.repeat):6.2f}"
            if helper is not None
            else "  (not built)"
        )
        py = _rate(n, partial(localwire.read_checked_py, fd, 0, dst, 0), args.repeat)
        print(
            f"  readinto {_rate(n, readinto, args.repeat):6.2f}   read_checked: C {c}   "
            f"pure Python {py:6.2f}"
        )
        dst.release()

    print(f"\na record (value at offset {RECORD_OFFSET}) read back, by how it was written:")
    dst = memoryview(target)[:n]
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "record")
        for how, write in (
            ("whole (one write)", _write_whole),
            ("unaligned 256 KiB blocks", _write_unaligned),
            ("write_checked (blocks end at multiples of 256 KiB)", _write_checked),
        ):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            write(fd, payload)
            os.close(fd)
            fd = os.open(path, os.O_RDONLY)
            print(f"  {how}: pread {_rate(n, partial(_pread_all, fd, dst, RECORD_OFFSET), args.repeat):6.2f}")
            os.close(fd)
    dst.release()


RECORD_OFFSET = 88  # a 24-byte header and a 64-byte key before the value


def _write_whole(fd: int, value: memoryview) -> None:
    localwire.pwrite_all(fd, bytes(RECORD_OFFSET), 0)
    localwire.pwrite_all(fd, value, RECORD_OFFSET)


def _write_unaligned(fd: int, value: memoryview) -> None:
    localwire.pwrite_all(fd, bytes(RECORD_OFFSET), 0)
    for at in range(0, value.nbytes, localwire.BLOCK):
        localwire.pwrite_all(fd, value[at : at + localwire.BLOCK], RECORD_OFFSET + at)


def _write_checked(fd: int, value: memoryview) -> None:
    localwire.write_checked(fd, RECORD_OFFSET, value, bytes(RECORD_OFFSET - 24))
    localwire.pwrite_all(fd, bytes(24), 0)


def _pread_all(fd: int, dst: memoryview, offset: int) -> None:
    got = 0
    while got < dst.nbytes:
        got += os.preadv(fd, [dst[got:]], offset + got)


if __name__ == "__main__":
    main()
