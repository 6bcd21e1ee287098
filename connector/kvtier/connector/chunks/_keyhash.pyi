"""Types of the C helper connector/_keyhash.c (see its opening comment)."""

from typing_extensions import Buffer

def pack_u32(token_ids: object, /) -> bytearray: ...
def chain(
    algo: str,
    prefix: Buffer,
    parent: Buffer,
    data: Buffer,
    chunk_bytes: int,
    first: int,
    extras: dict[int, bytes],
    /,
) -> list[bytes]: ...
