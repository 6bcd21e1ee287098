"""Get values received into buffers the caller gave back (``TierClient.recycle``), on a
real tier over both paths: the data port, and gRPC (multi-frame values)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pytest
import torch

from kvtier.connector.client import TierClient
from kvtier.testing.tierproc import TierProcess

MIB = 1 << 20
PATHS = [
    pytest.param({"data_path": "data"}, id="data-port"),
    pytest.param({"data_path": "grpc"}, id="grpc-frames"),  # the tier sends 1 MiB frames
]


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TierProcess]:
    tier = TierProcess.start(tmp_path_factory.mktemp("tier"), "--frame-bytes", str(MIB))
    yield tier
    tier.stop()


def stored(client: TierClient, **values: bytes) -> None:
    assert client.put([(k.encode(), v) for k, v in values.items()]) == len(values)


@pytest.mark.parametrize("path", PATHS)
def test_a_given_back_buffer_receives_the_next_value_of_its_size_whole(
    tier: TierProcess, path: dict[str, object]
) -> None:
    old, new = os.urandom(3 * MIB), os.urandom(3 * MIB)
    with TierClient(tier.target, **path) as c:  # type: ignore[arg-type]
        stored(c, old=old, new=new)
        values = c.get([b"old"])
        buffer_id = id(memoryview(values[0]).obj)  # type: ignore[arg-type]
        assert c.recycle(values) == 1 and values == []

        (got,) = c.get([b"new"])

        assert got is not None and bytes(got) == new  # no byte of the old value left
        assert id(memoryview(got).obj) == buffer_id  # received into the given-back buffer


@pytest.mark.parametrize("path", PATHS)
def test_a_buffer_still_seen_by_a_view_or_a_tensor_is_not_reused(
    tier: TierProcess, path: dict[str, object]
) -> None:
    first, second = os.urandom(2 * MIB), os.urandom(2 * MIB)
    with TierClient(tier.target, **path) as c:  # type: ignore[arg-type]
        stored(c, first=first, second=second)
        views = c.get([b"first"])
        head = views[0][:16]  # type: ignore[index]
        tensors = c.get([b"first"])
        with warnings.catch_warnings():  # a read-only buffer: only read here
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(tensors[0], dtype=torch.uint8)  # type: ignore[arg-type]

        assert c.recycle(views) == 0
        assert c.recycle(tensors) == 0
        c.get([b"second"])

        assert bytes(head) == first[:16]
        assert bytes(tensor[-16:].numpy()) == first[-16:]


def test_at_most_the_limit_is_kept_the_newest_first_and_small_values_never(
    tier: TierProcess,
) -> None:
    values = {f"v{i}": os.urandom(2 * MIB) for i in range(3)}
    with TierClient(tier.target, data_path="data", receive_buffer_bytes=5 * MIB) as c:
        stored(c, small=b"x" * 1000, **values)
        got = c.get([k.encode() for k in values], stop_at_first_miss=False)
        newest = id(memoryview(got[0]).obj)  # type: ignore[arg-type]
        assert c.recycle(got) == 3  # popped from the end: v0 is given back last
        assert c.recycle(c.get([b"small"])) == 0

        again = c.get([b"v1", b"v2", b"v0"])

        assert [bytes(v) for v in again] == [values["v1"], values["v2"], values["v0"]]  # type: ignore[arg-type]
        reused = [id(memoryview(v).obj) for v in again]  # type: ignore[arg-type]
        assert newest in reused
        assert len(set(reused)) == 3


def test_a_client_with_no_receive_buffers_keeps_nothing(tier: TierProcess) -> None:
    with TierClient(tier.target, data_path="data", receive_buffer_bytes=0) as c:
        stored(c, big=os.urandom(2 * MIB))
        assert c.recycle(c.get([b"big"])) == 0


def _numpy_bytes(size: int) -> object:
    """A receive buffer of another kind, as the KV worker makes on a GPU (a numpy array
    over a tensor's memory; there, a pinned tensor's)."""
    return torch.empty(size, dtype=torch.uint8).numpy()


@pytest.mark.parametrize("path", PATHS)
def test_values_are_received_into_the_buffers_an_allocator_makes_and_reused(
    tier: TierProcess, path: dict[str, object]
) -> None:
    old, new = os.urandom(3 * MIB), os.urandom(3 * MIB)
    with TierClient(tier.target, **path) as c:  # type: ignore[arg-type]
        stored(c, old=old, new=new)
        c.recycle(c.get([b"old"]))  # a bytearray kept before: dropped by the switch
        c.receive_into(_numpy_bytes)

        values = c.get([b"old"])
        buffer = memoryview(values[0]).obj  # type: ignore[arg-type]
        assert type(buffer).__name__ == "ndarray" and bytes(values[0]) == old  # type: ignore[arg-type]
        buffer_id = id(buffer)
        del buffer
        assert c.recycle(values) == 1
        (got,) = c.get([b"new"])

        assert got is not None and bytes(got) == new
        assert id(memoryview(got).obj) == buffer_id
        assert c.recycle([memoryview(bytearray(3 * MIB))]) == 0  # another kind is not kept
