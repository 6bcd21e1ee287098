"""``kvtier bench replace``: what replacing a file costs, by the way it is replaced.

Why the disk tier swaps a new record's name with the old one's instead of renaming over
it (``kvtier.cacheserver.disk``; docs/benchmarks.md, "Replacing a record without ext4's
flush"). Each row writes ``--mib`` MiB values to ``--keys`` files per thread, over and
over (``--rounds`` rewrites of every file after one round that creates them), with
``--threads`` 1 and 4 in ``--dir`` (default: a new directory under the current one,
removed afterwards: the file system the tier's ``--disk-dir`` would be on):

    rename over       written to tmp/, ``os.replace`` over the old file (the disk tier
                      before the swap)
    swap names        written to tmp/, ``renameat2(RENAME_EXCHANGE)`` with the old file,
                      whose new name in tmp/ is then removed (the disk tier now)
    truncate, rewrite ``open(path, "wb")`` and write (the ``plain file`` baseline of
                      ``kvtier bench tier``)

ext4 (``auto_da_alloc``, on by default) starts writing a file's data to the device when
the file is renamed over another or was truncated to nothing and then closed: it guards
applications that replace files without ``fsync``. Reported: GB/s of values written
(all threads together) and MiB the whole machine wrote to block devices meanwhile
(``pgpgout`` of ``/proc/vmstat``: anything else writing on the machine counts too).
Records replaced before the kernel's writeback reaches them are never written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.cacheserver.disk import can_swap_names, exchange

MIB = 1 << 20
Writer = Callable[[Path, int, int, bytes], None]


def _tmp_name(root: Path, thread: int, key: int, seq: int) -> Path:
    return root / "tmp" / f"{thread}-{key}.{seq}"


def _final(root: Path, thread: int, key: int) -> Path:
    return root / "v1" / f"{thread}-{key}"


def _write_new(path: Path, value: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, value)
    finally:
        os.close(fd)


def rename_over(root: Path, thread: int, key: int, value: bytes, seq: int) -> None:
    tmp = _tmp_name(root, thread, key, seq)
    _write_new(tmp, value)
    os.replace(tmp, _final(root, thread, key))


def swap_names(root: Path, thread: int, key: int, value: bytes, seq: int) -> None:
    tmp, final = _tmp_name(root, thread, key, seq), _final(root, thread, key)
    _write_new(tmp, value)
    if not exchange(tmp, final):
        raise RuntimeError(f"{final} vanished during the benchmark")
    os.unlink(tmp)


def truncate_rewrite(root: Path, thread: int, key: int, value: bytes, seq: int) -> None:
    with open(_final(root, thread, key), "wb") as f:
        f.write(value)


ROWS: list[tuple[str, Callable[[Path, int, int, bytes, int], None]]] = [
    ("rename over", rename_over),
    ("swap names", swap_names),
    ("truncate, rewrite", truncate_rewrite),
]


def _pgpgout_kib() -> int:
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("pgpgout "):
                return int(line.split()[1])
    return 0


def run_row(
    root: Path, write: Callable[[Path, int, int, bytes, int], None], threads: int, keys: int, rounds: int, value: bytes
) -> tuple[float, float]:
    """(GB/s, MiB written to devices) of ``rounds`` rewrites of ``keys`` files per thread."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "tmp").mkdir(parents=True)
    (root / "v1").mkdir()
    for t in range(threads):
        for k in range(keys):
            truncate_rewrite(root, t, k, value, 0)  # every file exists before the clock starts
    os.sync()

    errors: list[BaseException] = []

    def work(t: int) -> None:
        seq = 0
        try:
            for _ in range(rounds):
                for k in range(keys):
                    seq += 1
                    write(root, t, k, value, seq)
        except BaseException as exc:  # raised again below, in the caller's thread
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    out0 = _pgpgout_kib()
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    written = (_pgpgout_kib() - out0) / 1024
    return threads * keys * rounds * len(value) / elapsed / 1e9, written


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="kvtier bench replace", description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1, help="value size in MiB")
    p.add_argument("--keys", type=int, default=64, help="files per thread")
    p.add_argument("--rounds", type=int, default=4, help="rewrites of every file, timed")
    p.add_argument("--repeat", type=int, default=2, help="times each row runs (rows take turns)")
    p.add_argument("--dir", default=None, help="where to write (default: a new directory under the current one)")
    args = p.parse_args(list(argv))
    for flag in ("mib", "keys", "rounds", "repeat"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag}: at least 1")
    base = Path(tempfile.mkdtemp(prefix=".kvtier-bench-replace-", dir=args.dir or "."))
    value = os.urandom(args.mib * MIB)
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        if not can_swap_names(base):
            print(f"kvtier bench replace: the file system of {base.parent} cannot swap names "
                  "(renameat2 RENAME_EXCHANGE), so the disk tier renames there; pick --dir "
                  "on another file system", file=sys.stderr)  # fmt: skip
            return 1
        for rep in range(args.repeat):
            for threads in (1, 4):
                for name, write in ROWS:
                    print(f"[replace] {rep + 1}/{args.repeat} {name} x{threads}", file=sys.stderr, flush=True)
                    got = run_row(base / "files", write, threads, args.keys, args.rounds, value)
                    results.setdefault((name, threads), []).append(got)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{args.mib} MiB values, {args.keys} files per thread rewritten {args.rounds} times, "
          f"{args.repeat} runs (min-max); load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| how | threads | GB/s | MiB written to devices |")
    print("|---|---:|---:|---:|")
    for (name, threads), got in results.items():
        rates, written = [g[0] for g in got], [g[1] for g in got]
        print(f"| {name} | {threads} | {min(rates):.2f}-{max(rates):.2f} | {min(written):.0f}-{max(written):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
