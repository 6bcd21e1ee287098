"""A bounded, structure-aware fuzz of the data port's framing, on a real tier process.

Every header field at its edges (magic, version, op, flags, count, table_len),
tables whose key lengths, value lengths and counts disagree, truncated and
oversized frames, callers with and without a token, peers that declare a
large value and stop, slow-loris peers that dribble a header, more connections
than --data-max-connections. The guarantees are gRPC's (test_fuzz.py): every
answer is a status from the contract (never INTERNAL), the server stays up and
serves a healthy client meanwhile, its memory stays bounded, and its
connection limit holds.

CI runs a bounded number of examples; a longer run is
``KVTIER_FUZZ_EXAMPLES=20000 scripts/test tests/cacheserver/test_fuzz_dataport.py``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.connector.client import TierClient
from kvtier.proto import datawire as dw
from kvtier.proto.datawire import Op, Status
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.waits import wait_for

EXAMPLES = int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "150"))
TOKEN = "f" * 24 + "-fuzz-tenant-token"
MAX_KEYS, MAX_KEY, MAX_VALUE = 64, 256, 1 << 20
TIMEOUT_S = 2.0  # --data-timeout
CONNECTIONS = 24  # --data-max-connections
ALLOWED = {
    Status.OK,
    Status.INVALID_ARGUMENT,
    Status.RESOURCE_EXHAUSTED,
    Status.UNAUTHENTICATED,
    Status.UNAVAILABLE,
}
U16, U32, U64 = 2**16 - 1, 2**32 - 1, 2**64 - 1
CASES = {"run": 0, "replies": 0}


@pytest.fixture(scope="module")
def fuzz_tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TierProcess]:
    directory = tmp_path_factory.mktemp("fuzz-data")
    tokens = directory / "tokens"
    tokens.mkdir()
    (tokens / "fuzz").write_text(TOKEN)
    tier = TierProcess.start(
        directory, "--auth-tokens", str(tokens), "--max-keys", str(MAX_KEYS),
        "--max-value-bytes", "1MiB", "--incoming-bytes", "8MiB", "--data-timeout", f"{TIMEOUT_S}s",
        "--data-max-connections", str(CONNECTIONS), "--ram-bytes", "32MiB", "--disk-bytes", "0",
    )  # fmt: skip
    yield tier
    tier.stop()
    print(f"\n[fuzz] data port: {CASES['run']} cases, {CASES['replies']} replies, 0 crashes")


def rss(tier: TierProcess) -> int:
    assert tier.proc is not None
    for line in Path(f"/proc/{tier.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def baseline(fuzz_tier: TierProcess) -> int:
    healthy(fuzz_tier)
    return rss(fuzz_tier)


def healthy(tier: TierProcess) -> None:
    """A well-behaved client round-trips a value over the data port within its deadline."""
    with TierClient(tier.target, token=TOKEN, data_path="data", timeout_s=10) as c:
        data = os.urandom(50_000)
        assert c.put([(b"healthy", data)]) == 1
        (got,) = c.get([b"healthy"])
        assert got is not None and bytes(got) == data


# -- structure-aware strategies --------------------------------------------------------

edge_u16 = st.sampled_from([0, 1, 2, MAX_KEY - 1, MAX_KEY, MAX_KEY + 1, U16]) | st.integers(0, U16)
edge_u32 = st.sampled_from([0, 1, MAX_KEYS, MAX_KEYS + 1, 2**31, U32]) | st.integers(0, U32)
edge_len = st.sampled_from([0, 1, MAX_VALUE - 1, MAX_VALUE, MAX_VALUE + 1, 2**32, U64]) | st.integers(
    0, 2 * MAX_VALUE
)
keys = st.binary(min_size=0, max_size=MAX_KEY + 2)


@st.composite
def get_table(draw: st.DrawFn) -> tuple[int, bytes]:
    ks = draw(st.lists(keys, max_size=8))
    lengths = [draw(st.sampled_from([len(k), len(k) + 1, max(0, len(k) - 1)])) for k in ks]
    table = b"".join(dw.GET_KEY.pack(n) + k for n, k in zip(lengths, ks, strict=True))
    return len(ks), table


@st.composite
def put_table(draw: st.DrawFn) -> tuple[int, bytes, list[int]]:
    items = draw(st.lists(st.tuples(keys, edge_len), max_size=4))
    table = b"".join(dw.PUT_ITEM.pack(min(len(k), U16), n) + k for k, n in items)
    return len(items), table, [n for _, n in items]


@st.composite
def request(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """(request header + table, what follows: values, garbage or nothing)."""
    magic = draw(st.sampled_from([dw.MAGIC, dw.MAGIC, dw.MAGIC, b"KVTX", b"\x00" * 4]))
    version = draw(st.sampled_from([dw.VERSION, dw.VERSION, 0, 2, 255]))
    op = draw(st.sampled_from([Op.HELLO, Op.GET, Op.GET, Op.PUT, Op.PUT, 0, 4, 255]))
    flags = draw(st.sampled_from([0, dw.FLAG_STOP_AT_FIRST_MISS, U16]))
    tail = b""
    if op == Op.HELLO:
        table = draw(st.sampled_from([f"Bearer {TOKEN}".encode(), b"", b"Bearer nope", b"\xff\xfe"]))
        count = draw(edge_u32)
    elif op == Op.GET:
        count, table = draw(get_table())
    else:
        count, table, lengths = draw(put_table())
        sent = min(sum(lengths), 2 * MAX_VALUE)
        tail = bytes(draw(st.sampled_from([0, sent, max(0, sent - 1), min(sent + 7, 2 * MAX_VALUE)])))
    count = min(U32, draw(st.sampled_from([count, count, count + 1, max(0, count - 1)]) | edge_u32))
    table_len = min(U32, draw(st.sampled_from([len(table)] * 4 + [len(table) + 1, max(0, len(table) - 1)]) | edge_u32))
    header = dw.REQUEST.pack(magic, version, op, flags, count, table_len)
    frame = header + table
    cut = draw(st.sampled_from([len(frame)] * 6 + [0, 5, 15, len(frame) // 2]))
    return frame[:cut], tail


def exchange(port: int, hello: bool, frame: bytes, tail: bytes) -> list[int]:
    """Sends one request (after a HELLO, maybe) and reads replies until the server is done."""
    statuses: list[int] = []
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.settimeout(TIMEOUT_S + 3)
        try:  # the server may answer and close at any point: a reset is an answer too
            if hello:
                auth = f"Bearer {TOKEN}".encode()
                sock.sendall(dw.request(Op.HELLO, 0, len(auth)) + auth)
            sock.sendall(frame + tail)
            sock.shutdown(socket.SHUT_WR)  # nothing more comes: the server must not wait forever
            while chunk := sock.recv(1 << 20):
                data += chunk
        except TimeoutError:
            pytest.fail("the server neither answered nor closed within its --data-timeout")
        except OSError:
            pass
    pos = 0  # replies are found by their magic; GET entries between them are skipped
    while (pos := data.find(dw.MAGIC + bytes([dw.VERSION]), pos)) >= 0 and pos + dw.REPLY.size <= len(data):
        _, _, _, status, _, _, text_len = dw.REPLY.unpack_from(data, pos)
        if status in ALLOWED | {Status.INTERNAL, Status.DEADLINE_EXCEEDED, Status.CANCELLED}:
            statuses.append(status)
        pos += dw.REPLY.size + text_len
    return statuses


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(hello=st.booleans(), req=request())
def test_random_requests_get_a_contract_status_and_never_crash_the_port(
    fuzz_tier: TierProcess, baseline: int, hello: bool, req: tuple[bytes, bytes]
) -> None:
    frame, tail = req
    statuses = exchange(fuzz_tier.data_port, hello, frame, tail)
    CASES["run"] += 1
    CASES["replies"] += len(statuses)
    assert Status.INTERNAL not in statuses
    assert set(statuses) <= ALLOWED | {Status.OK}, statuses


def test_slow_loris_peers_are_cut_by_the_request_deadline_while_a_client_is_served(
    fuzz_tier: TierProcess, baseline: int
) -> None:
    socks = [socket.create_connection(("127.0.0.1", fuzz_tier.data_port)) for _ in range(8)]
    header = dw.request(Op.GET, 1, 10)
    try:
        started = time.monotonic()
        for i in range(len(header)):  # one byte of a header every 0.3 s, from every peer
            if time.monotonic() - started > TIMEOUT_S + 1:
                break
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.sendall(header[i : i + 1])
            healthy(fuzz_tier)
            time.sleep(0.3)
        for sock in socks:  # each was cut (the header must arrive whole within --data-timeout)
            sock.settimeout(3)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(100) == b""
    finally:
        for sock in socks:
            sock.close()


def test_a_peer_that_declares_a_large_value_and_stops_is_cut_and_gives_its_budget_back(
    fuzz_tier: TierProcess, baseline: int
) -> None:
    with socket.create_connection(("127.0.0.1", fuzz_tier.data_port)) as sock:
        auth = f"Bearer {TOKEN}".encode()
        sock.sendall(dw.request(Op.HELLO, 0, len(auth)) + auth)
        table = dw.put_table([(b"big", MAX_VALUE)])
        sock.sendall(dw.request(Op.PUT, 1, len(table)) + table + b"x" * 100)
        assert wait_for(lambda: fuzz_tier.metric("kvtier_server_incoming_bytes") == MAX_VALUE, 5)  # reserved
        healthy(fuzz_tier)
        sock.settimeout(TIMEOUT_S + 5)
        try:
            while sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
    deadline = time.monotonic() + 5
    while fuzz_tier.metric("kvtier_server_incoming_bytes") != 0:
        assert time.monotonic() < deadline, "the stalled value's budget was not given back"
        time.sleep(0.1)


def test_connections_beyond_the_limit_are_closed_and_clients_move_to_grpc(
    fuzz_tier: TierProcess, baseline: int
) -> None:
    held = [socket.create_connection(("127.0.0.1", fuzz_tier.data_port)) for _ in range(CONNECTIONS)]
    try:
        time.sleep(0.5)
        with socket.create_connection(("127.0.0.1", fuzz_tier.data_port), timeout=5) as extra:
            try:
                extra.sendall(dw.request(Op.HELLO, 0, 0))
                got = extra.recv(100)
            except (ConnectionResetError, BrokenPipeError):
                got = b""
            assert got == b"", "a connection beyond --data-max-connections was served"
        assert fuzz_tier.metric("kvtier_server_data_connections") <= CONNECTIONS
        with TierClient(fuzz_tier.target, token=TOKEN, timeout_s=10) as auto:  # auto: gRPC meanwhile
            assert auto.put([(b"over-grpc", b"v")]) == 1
            assert auto.get([b"over-grpc"]) == [b"v"]
        assert fuzz_tier.metric("kvtier_server_requests_total", op="Put", code="OK") >= 1
    finally:
        for sock in held:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
    assert fuzz_tier.metric("kvtier_server_data_connections_refused_total") >= 1


def test_the_server_survived_the_fuzz_with_bounded_memory_and_no_unhandled_exception(
    fuzz_tier: TierProcess, baseline: int
) -> None:
    healthy(fuzz_tier)
    deadline = time.monotonic() + 10
    while fuzz_tier.metric("kvtier_server_incoming_bytes") != 0:  # cut connections give it back
        assert time.monotonic() < deadline
        time.sleep(0.1)
    grown = rss(fuzz_tier) - baseline
    print(f"\n[fuzz] data port: server memory {grown / (1 << 20):+.1f} MiB over the fuzz")
    assert grown < 64 << 20
    log = fuzz_tier.log.read_text()
    assert "Traceback" not in log and "internal error" not in log
    for op in ("DataHello", "DataGet", "DataPut", "DataInvalid"):
        assert fuzz_tier.metric("kvtier_server_requests_total", op=op, code="INTERNAL") == 0
