"""Types of the C helper proto/kvtier/proto/_copyhash.c (see its opening comment)."""

from typing_extensions import Buffer

FUSED: int  # 1 where copies and their hashes run in one pass (x86-64 with AVX2)


def copy_checked(dst: Buffer, /, *sources: Buffer) -> int: ...
def copy_streamed(dst: Buffer, /, *sources: Buffer) -> int: ...
def read_checked(fd: int, offset: int, dst: Buffer, prefix_len: int, /) -> int: ...
