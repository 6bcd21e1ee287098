"""Opening a file on the event loop only when that costs no I/O.

A same-node Get of a value held only on disk is answered with the value's record file,
which the tier opens and whose header it reads (``record.open_file``). In a worker
thread each file costs a thread hop, ~100 us on these machines: for a batch of 1 MiB
values, as much again as the client's read of each value (docs/benchmarks.md, "Redis
tier against redis-py, disk tier against plain files"). On the event loop it costs
~6 us, but an open or a read that has to wait for the disk would stall every
connection of the tier. So the loop only does what cannot wait: ``openat2`` with
``RESOLVE_CACHED`` (Linux 5.12) opens a path only when the kernel's dentry cache
resolves all of it, and ``preadv2`` with ``RWF_NOWAIT`` reads only what the page cache
holds; either answers EAGAIN otherwise, and the caller goes to a thread. Where
``openat2`` is missing (an older kernel, a seccomp profile without it) the first such
error turns this off for the process.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

__all__ = ["open_cached"]

_SYS_OPENAT2 = 437  # x86-64 and the generic table (arm64) alike
_RESOLVE_CACHED = 0x20
_AT_FDCWD = -100
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EPERM, errno.E2BIG, errno.EOPNOTSUPP}


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


# openat2's arguments, made once (read only by the kernel): read-only, in the dentry cache
_HOW = ctypes.byref(_OpenHow(os.O_RDONLY | os.O_CLOEXEC, 0, _RESOLVE_CACHED))
_HOW_SIZE = ctypes.c_size_t(ctypes.sizeof(_OpenHow))
_libc: ctypes.CDLL | None = None
_enabled = sys.platform == "linux" and hasattr(os, "RWF_NOWAIT")
if _enabled:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.syscall.restype = ctypes.c_long


def open_cached(path: str | os.PathLike[str]) -> int | None:
    """A read-only descriptor of ``path`` when opening it needs no I/O, else None (not
    cached, not there, not allowed, or not supported here: a thread's ``open`` says which)."""
    global _enabled
    if not _enabled or _libc is None:
        return None
    fd = int(_libc.syscall(_SYS_OPENAT2, _AT_FDCWD, os.fsencode(path), _HOW, _HOW_SIZE))
    if fd >= 0:
        return fd
    if ctypes.get_errno() in _UNSUPPORTED:
        _enabled = False
    return None
