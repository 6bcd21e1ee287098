from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_length",)
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    prefix_length: int
    def __init__(self, prefix_length: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("keys", "stop_at_first_miss")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_FIRST_MISS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    stop_at_first_miss: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., stop_at_first_miss: _Optional[bool] = ...) -> None: ...

class GetFrame(_message.Message):
    __slots__ = ("index", "found", "total_length", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    found: bool
    total_length: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., found: _Optional[bool] = ..., total_length: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutFrame(_message.Message):
    __slots__ = ("key", "total_length", "offset", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    total_length: int
    offset: int
    data: bytes
    def __init__(self, key: _Optional[bytes] = ..., total_length: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "rejected")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    rejected: int
    def __init__(self, stored: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "healthy", "used_bytes", "capacity_bytes", "entries", "hits", "misses", "evictions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    healthy: bool
    used_bytes: int
    capacity_bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    def __init__(self, name: _Optional[str] = ..., healthy: _Optional[bool] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., entries: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "max_value_bytes", "frame_bytes", "max_keys_per_request", "tenant", "data_port")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MAX_VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    max_value_bytes: int
    frame_bytes: int
    max_keys_per_request: int
    tenant: str
    data_port: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., max_value_bytes: _Optional[int] = ..., frame_bytes: _Optional[int] = ..., max_keys_per_request: _Optional[int] = ..., tenant: _Optional[str] = ..., data_port: _Optional[int] = ...) -> None: ...
