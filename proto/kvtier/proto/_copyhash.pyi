"""Types of the C helper proto/kvtier/proto/_copyhash.c (see its opening comment)."""

from typing_extensions import Buffer

def copy_checked(dst: Buffer, /, *sources: Buffer) -> int: ...
