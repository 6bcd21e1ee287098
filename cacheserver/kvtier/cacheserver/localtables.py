"""The same-node transport's request tables, parsed: keys, and a Put's staged values.

Pure functions over bytes a client sent (``kvtier.proto.localwire``), checked with the
request core's limits (``kvtier.cacheserver.core``); every error names the field and
what is accepted. ``tests/cacheserver/test_fuzz_local.py`` fuzzes them through a real
tier.
"""

from __future__ import annotations

from kvtier.cacheserver.core import RequestCore
from kvtier.cacheserver.errors import InvalidRequest, RequestError
from kvtier.proto import localwire as lw


class Lost(Exception):
    """The stream cannot be parsed any more: answer ``error`` (if possible) and close."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(str(error))
        self.error = error


def parse_keys(core: RequestCore, op_name: str, count: int, table: bytearray) -> list[bytes]:
    """``count`` x (key_len u16, key), every key within ``--max-key-bytes``."""
    view = memoryview(table)
    keys, pos = [], 0
    for i in range(count):
        if pos + lw.KEY.size > len(view):
            raise InvalidRequest(f"{op_name}.table: ends inside key {i} of {count}")
        (n,) = lw.KEY.unpack_from(view, pos)
        pos += lw.KEY.size
        if pos + n > len(view):
            raise InvalidRequest(f"{op_name}.table: key {i} runs past the end of the table")
        key = bytes(view[pos : pos + n])
        pos += n
        core.check_key(f"{op_name}.keys[{i}]", key)
        keys.append(key)
    if pos != len(view):
        raise InvalidRequest(
            f"{op_name}.table: {len(view) - pos} bytes after the last of {count} keys"
        )
    return keys


def parse_put_items(
    core: RequestCore, count: int, table: bytearray
) -> list[tuple[bytes, int, int, int]]:
    """``count`` x (PUT_ITEM, key): (key, staging offset, length, checksum) each."""
    view = memoryview(table)
    items, pos = [], 0
    for i in range(count):
        if pos + lw.PUT_ITEM.size > len(view):
            raise InvalidRequest(f"LocalPut.table: ends inside value {i} of {count}")
        n, offset, length, crc = lw.PUT_ITEM.unpack_from(view, pos)
        pos += lw.PUT_ITEM.size
        if pos + n > len(view):
            raise InvalidRequest(f"LocalPut.table: key {i} runs past the end of the table")
        key = bytes(view[pos : pos + n])
        pos += n
        core.check_key(f"LocalPut.keys[{i}]", key)
        core.check_value_length(f"LocalPut.values[{i}].length", length)
        items.append((key, offset, length, crc))
    if pos != len(view):
        raise InvalidRequest(
            f"LocalPut.table: {len(view) - pos} bytes after the last of {count} values"
        )
    return items
