"""Busy processes that compete with everything else for the CPUs (deliberate contention).

``with busy_cpus(4): ...`` runs four Python processes that spin at normal priority until
the block ends, so every thread of the processes under test (engines, the tier, their
background senders) is descheduled at arbitrary points, as on a loaded machine. They are
stopped by their PIDs.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator


def busy_count(per_cpu: int = 2) -> int:
    """``per_cpu`` busy processes for each CPU this process may run on."""
    return per_cpu * len(os.sched_getaffinity(0))


@contextlib.contextmanager
def busy_cpus(count: int) -> Iterator[list[int]]:
    """Runs ``count`` spinning processes for the duration of the block; yields their PIDs."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(10)
