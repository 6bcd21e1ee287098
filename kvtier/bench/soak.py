"""A bounded soak of the cache tier: steady load, memory and file descriptors sampled.

    PYTHONSAFEPATH=1 .venv/bin/python -m kvtier.bench.soak --minutes 10

Starts a ``kvtier server`` (RAM + disk, small RAM so eviction runs all the
time), drives it with a few clients doing Put/Lookup/Get for ``--minutes``,
and prints the server's RSS and open file descriptors every ``--every``
seconds, then the growth between the first and the last quarter. Flat means
healthy. Not part of CI (it is long by design); the numbers go in
docs/security.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvtier.connector.client import TierClient
from kvtier.connector.errors import TierError
from kvtier.testing.tierproc import TierProcess


def sample(pid: int) -> tuple[int, int]:
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return rss, fds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--clients", type=int, default=4)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tier = TierProcess.start(Path(d), "--ram-bytes", "64MiB", "--disk-bytes", "256MiB")
        assert tier.proc is not None
        stop = threading.Event()
        ops = [0]

        def client(n: int) -> None:
            payload = os.urandom(256 << 10)
            with TierClient(tier.target, timeout_s=10) as c:
                i = 0
                while not stop.is_set():
                    keys = [b"s%d-%d-%d" % (n, i, j) for j in range(8)]
                    try:
                        c.put([(k, payload) for k in keys])
                        c.lookup(keys)
                        c.get(keys[:4])
                        c.get([b"s%d-%d-0" % (n, max(0, i - 50))])
                    except TierError as exc:
                        print(f"client {n}: {exc}", file=sys.stderr)
                    ops[0] += 4
                    i += 1

        threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(a.clients)]
        for t in threads:
            t.start()
        samples: list[tuple[float, int, int]] = []
        end = time.monotonic() + a.minutes * 60
        t0 = time.monotonic()
        try:
            while time.monotonic() < end:
                time.sleep(a.every)
                rss, fds = sample(tier.proc.pid)
                samples.append((time.monotonic() - t0, rss, fds))
                print(f"{samples[-1][0]:7.0f}s  rss {rss / 2**20:8.1f} MiB  fds {fds:4d}  calls {ops[0]}", flush=True)
        finally:
            stop.set()
            for t in threads:
                t.join(15)
            tier.stop()
    q = max(1, len(samples) // 4)
    first, last = samples[:q], samples[-q:]
    rss_growth = (sum(s[1] for s in last) / len(last)) / (sum(s[1] for s in first) / len(first)) - 1
    fd_growth = max(s[2] for s in last) - max(s[2] for s in first)
    print(f"rss growth first->last quarter: {rss_growth:+.1%}; fd growth: {fd_growth:+d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
