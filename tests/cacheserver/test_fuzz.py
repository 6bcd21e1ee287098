"""A bounded fuzz run over the wire: malformed frames, huge and empty fields, random streams.

CI runs a bounded number of examples; a longer run is
``KVTIER_FUZZ_EXAMPLES=20000 scripts/test tests/cacheserver/test_fuzz.py``.
Every call must end with a status from the contract (never INTERNAL or
UNKNOWN), and the server must stay up with no unhandled exception in its log.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.proto import SERVICE_NAME, wire
from kvtier.testing.tierproc import TierProcess, health_status

EXAMPLES = int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "150"))
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@pytest.fixture(scope="module")
def fuzz_tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TierProcess]:
    tier = TierProcess.start(tmp_path_factory.mktemp("fuzz"), "--max-value-bytes", "1MiB", "--max-keys", "64")
    yield tier
    tier.stop()


@pytest.fixture(scope="module")
def channel(fuzz_tier: TierProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(fuzz_tier.target, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        yield ch


def varint(n: int) -> bytes:
    return wire._varint(n)


# Frames that are almost right: real tags with random values, lengths and orders.
field = st.one_of(
    st.tuples(st.sampled_from([1, 2, 3, 4, 15, 5, 100]), st.sampled_from([0, 2, 1, 5])).flatmap(
        lambda fw: (
            st.integers(0, 2**64 - 1).map(lambda v: varint(fw[0] << 3 | 0) + varint(v))
            if fw[1] == 0
            else st.binary(max_size=300).map(lambda b: varint(fw[0] << 3 | 2) + varint(len(b)) + b)
            if fw[1] == 2
            else st.binary(min_size=0, max_size=9).map(lambda b: varint(fw[0] << 3 | fw[1]) + b)
        )
    ),
    st.binary(max_size=40),
)
message = st.lists(field, max_size=6).map(b"".join)
big_key_frame = st.integers(0, 2**40).map(lambda n: wire.encode_put_frame(b"k" * 300, n, 0, b"x"))


def call(channel: grpc.Channel, method: str, payload: bytes | list[bytes]) -> grpc.StatusCode:
    path = f"/{SERVICE_NAME}/{method}"
    try:
        if method == "Put":
            assert isinstance(payload, list)
            channel.stream_unary(path, wire.identity, wire.identity)(iter(payload), timeout=10)
        elif method == "Get":
            list(channel.unary_stream(path, wire.identity, wire.identity)(payload, timeout=10))
        else:
            channel.unary_unary(path, wire.identity, wire.identity)(payload, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined,no-any-return]
    return grpc.StatusCode.OK


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["Lookup", "Get", "Delete", "Stats"]), payload=message)
def test_random_unary_requests_get_a_contract_status(channel: grpc.Channel, method: str, payload: bytes) -> None:
    assert call(channel, method, payload) in ALLOWED


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.one_of(message, big_key_frame), max_size=5))
def test_random_put_streams_get_a_contract_status(channel: grpc.Channel, frames: list[bytes]) -> None:
    assert call(channel, "Put", frames) in ALLOWED


def test_the_server_survived_the_fuzz_without_an_unhandled_exception(
    fuzz_tier: TierProcess, channel: grpc.Channel
) -> None:
    assert health_status(fuzz_tier.target) == health_pb2.HealthCheckResponse.SERVING
    log = fuzz_tier.log.read_text()
    assert "Traceback" not in log and "internal error" not in log
    assert fuzz_tier.metric("kvtier_server_requests_total", op="Lookup", code="INTERNAL") == 0
