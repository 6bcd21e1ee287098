"""``kvtier bench alloc``: what receiving a large value into fresh memory costs.

Why the tier and the client keep receive buffers (docs/benchmarks.md, "Memory for
large values"). For values of ``--mib`` MiB, each row is one way to end up with the
value's bytes in a buffer, timed over ``--repeat`` rounds (rows take turns):

    fresh bytearray, filled     ``bytearray(n)``, then the bytes copied in through a
                                memoryview (as ``recv_into`` fills it: a receive into
                                new memory)
    kept bytearray, filled      the same copy into a buffer allocated before (a
                                receive into a recycled buffer)
    fresh bytearray alone       ``bytearray(n)``, nothing copied
    mmap MAP_POPULATE, filled   an anonymous mapping populated up front, then the copy

Above glibc's largest mmap threshold (32 MiB) every fresh buffer is new pages from the
kernel, zeroed and faulted in, and unmapped when it goes. Times are elapsed
milliseconds (page faults are the kernel's time, so CPU time of the thread would
hide nothing here but the wait for the core): median and best of the rounds.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

MIB = 1 << 20


def rows(n: int) -> list[tuple[str, Callable[[], object]]]:
    source = os.urandom(n)
    kept = bytearray(n)

    def fresh_filled() -> object:
        buf = bytearray(n)
        memoryview(buf)[:] = source
        return buf

    def kept_filled() -> object:
        memoryview(kept)[:] = source
        return kept

    def mmap_filled() -> object:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        with mmap.mmap(-1, n, flags=flags) as m:
            memoryview(m)[:] = source
        return None

    return [
        ("fresh bytearray, filled", fresh_filled),
        ("kept bytearray, filled", kept_filled),
        ("fresh bytearray alone", lambda: bytearray(n)),
        ("mmap MAP_POPULATE, filled", mmap_filled),
    ]


def measure(runs: list[tuple[str, Callable[[], object]]], repeat: int) -> list[list[float]]:
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeat):
        for i, (_, run) in enumerate(runs):
            start = time.perf_counter()
            result = run()
            times[i].append((time.perf_counter() - start) * 1e3)
            del result
    return times


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="kvtier bench alloc", description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="value size in MiB")
    p.add_argument("--repeat", type=int, default=21, help="rounds")
    args = p.parse_args(list(argv))
    if args.mib < 1 or args.repeat < 1:
        p.error("--mib and --repeat: at least 1")
    runs = rows(args.mib * MIB)
    runs[0][1]()  # warm-up: the source and the kept buffer are mapped already
    times = measure(runs, args.repeat)
    print(f"{args.mib} MiB values, {args.repeat} rounds, elapsed time; load average "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| what | median ms | best ms |")
    print("|---|---:|---:|")
    for (name, _), t in zip(runs, times, strict=True):
        print(f"| {name} | {statistics.median(t):.2f} | {min(t):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
