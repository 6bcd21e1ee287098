"""The data port (raw-bytes Get/Put beside gRPC) on real tier processes, over real sockets."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.connector.client import TierClient
from kvtier.connector.errors import TierRejected, TierUnavailable
from kvtier.proto import datawire as dw
from kvtier.proto.datawire import Op, Status
from kvtier.testing.redisprocs import TlsFiles
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.waits import wait_for

TOKEN_A = "a" * 24 + "-tenant-a-token"
TOKEN_B = "b" * 24 + "-tenant-b-token"


def start_data_tier(start_tier: Callable[..., TierProcess], *flags: str) -> tuple[TierProcess, int]:
    tier = start_tier(*flags, data_port=True)
    return tier, tier.data_port


@pytest.fixture
def data_tier(start_tier: Callable[..., TierProcess]) -> tuple[TierProcess, int]:
    return start_data_tier(start_tier, "--max-keys", "64", "--max-value-bytes", "80MiB")


@pytest.fixture
def client(data_tier: tuple[TierProcess, int]) -> Iterator[TierClient]:
    with TierClient(data_tier[0].target, timeout_s=30, data_path="data") as c:
        yield c


@pytest.fixture
def tokens_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tokens"
    d.mkdir()
    (d / "team-a").write_text(TOKEN_A)
    (d / "team-b").write_text(TOKEN_B)
    return d


def value(n: int, seed: int = 0) -> bytes:
    return (seed.to_bytes(4, "little") + os.urandom(12)) * (n // 16) + b"x" * (n % 16)


def as_bytes(values: list[bytes | memoryview | None]) -> list[bytes | None]:
    return [None if v is None else bytes(v) for v in values]


# -- a raw data-port client, for what TierClient never sends --------------------------


def raw_connect(port: int, authorization: str = "") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if authorization:
        auth = authorization.encode()
        sock.sendall(dw.request(Op.HELLO, 0, len(auth)) + auth)
        assert read_reply(sock)[0] == Status.OK
    return sock


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def read_reply(sock: socket.socket) -> tuple[int, int, int, str]:
    magic, version, _op, status, count, extra, n = dw.REPLY.unpack(recv_exact(sock, dw.REPLY.size))
    assert (magic, version) == (dw.MAGIC, dw.VERSION)
    return status, count, extra, recv_exact(sock, n).decode()


def closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


# -- round trips ------------------------------------------------------------------------


def test_the_tier_advertises_its_data_port_in_stats(data_tier: tuple[TierProcess, int]) -> None:
    tier, port = data_tier
    with TierClient(tier.target, data_path="grpc") as c:
        assert c.stats().data_port == port


def test_single_and_batched_values_round_trip(client: TierClient) -> None:
    a, b, c = value(1), value(100_000, 1), value(3 << 20, 2)
    assert client.put([(b"a", a)]) == 1
    assert client.put([(b"b", b), (b"c", [c[:7], c[7:]])]) == 2  # a value given as two buffers
    assert as_bytes(client.get([b"a"])) == [a]
    assert as_bytes(client.get([b"a", b"b", b"c"])) == [a, b, c]


def test_a_64_mib_value_round_trips_whole(client: TierClient) -> None:
    big = value(64 << 20 | 12345)
    assert client.put([(b"big", big)]) == 1
    (got,) = client.get([b"big"])
    assert got is not None and bytes(got) == big


def test_get_stops_at_the_first_miss_only_when_asked(client: TierClient) -> None:
    client.put([(b"a", b"1"), (b"c", b"3")])
    assert as_bytes(client.get([b"a", b"b", b"c"])) == [b"1", None]
    assert as_bytes(client.get([b"a", b"b", b"c"], stop_at_first_miss=False)) == [b"1", None, b"3"]


def test_values_are_the_same_entries_over_grpc_and_over_the_data_port(data_tier: tuple[TierProcess, int]) -> None:
    tier, _ = data_tier
    with TierClient(tier.target, data_path="data") as data, TierClient(tier.target, data_path="grpc") as grpc_:
        data.put([(b"via-data", b"d")])
        grpc_.put([(b"via-grpc", b"g")])
        assert as_bytes(grpc_.get([b"via-data"])) == [b"d"]
        assert as_bytes(data.get([b"via-grpc"])) == [b"g"]
        assert grpc_.lookup([b"via-data", b"via-grpc"]) == 2


def test_threads_sharing_one_client_each_read_back_what_they_wrote(client: TierClient) -> None:
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(10):
                key, data = b"t%d-%d" % (n, i), value(50_000 + n, n)
                assert client.put([(key, data)]) == 1
                assert as_bytes(client.get([key])) == [data]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


def test_metrics_count_data_port_requests_and_bytes(data_tier: tuple[TierProcess, int], client: TierClient) -> None:
    tier, _ = data_tier
    client.put([(b"m", b"x" * 1000)])
    client.get([b"m", b"none"], stop_at_first_miss=False)
    assert tier.metric("kvtier_server_requests_total", op="DataPut", code="OK") == 1
    # (A request is counted once its reply is sent: just after the client has it, maybe.)
    assert wait_for(lambda: tier.metric("kvtier_server_requests_total", op="DataGet", code="OK") == 1)
    assert tier.metric("kvtier_server_received_bytes_total") == 1000
    assert tier.metric("kvtier_server_sent_bytes_total") == 1000
    assert tier.metric("kvtier_server_get_keys_total", result="miss") == 1


# -- limits and bad input -----------------------------------------------------------------


def test_too_many_keys_is_resource_exhausted_naming_the_field(client: TierClient) -> None:
    with pytest.raises(TierRejected, match=r"RESOURCE_EXHAUSTED: DataGet.count: 65 keys .* at most 64 \(--max-keys\)"):
        client.get([b"k%d" % i for i in range(65)])
    assert client.put([(b"after", b"ok")]) == 1  # the client and the tier carry on


def test_a_value_over_the_limit_is_resource_exhausted_and_not_stored(client: TierClient) -> None:
    with pytest.raises(TierRejected, match=r"RESOURCE_EXHAUSTED: DataPut.values\[1\].length: .* \(--max-value-bytes\)"):
        client.put([(b"small", b"s"), (b"huge", bytes((80 << 20) + 1))])
    assert client.get([b"small", b"huge"], stop_at_first_miss=False) == [None, None]


def test_an_oversized_or_empty_key_is_invalid_and_nothing_is_stored(client: TierClient) -> None:
    with pytest.raises(TierRejected, match=r"INVALID_ARGUMENT: DataPut.keys\[0\]: key of 257 bytes; keys are 1..256"):
        client.put([(b"k" * 257, b"v")])
    with pytest.raises(TierRejected, match=r"INVALID_ARGUMENT: DataGet.keys\[1\]: key of 0 bytes"):
        client.get([b"a", b""])
    assert client.get([b"k" * 256]) == [None]


WRITTEN_THROUGH = ("--ram-bytes", "1", "--write-policy", "write-through")  # every value to disk


@pytest.mark.parametrize("flags", [(), WRITTEN_THROUGH], ids=["RAM tier", "written through to disk"])
def test_a_connection_cut_mid_value_stores_nothing_of_it(
    start_tier: Callable[..., TierProcess], flags: tuple[str, ...]
) -> None:
    """Written through, the first value reaches the disk tier before the second arrives; the
    cut of the second leaves the first stored whole there too."""
    tier, port = start_data_tier(start_tier, "--max-value-bytes", "80MiB", *flags)
    first, second = value(1 << 20), value(4 << 20, 1)
    table = dw.put_table([(b"first", len(first)), (b"second", len(second))])
    with raw_connect(port) as sock:
        sock.sendall(dw.request(Op.PUT, 2, len(table)) + table)
        assert read_reply(sock)[0] == Status.OK
        sock.sendall(first + second[: len(second) // 2])
    deadline = time.monotonic() + 10
    with TierClient(tier.target, data_path="data") as c:
        # (Not Lookup: a disk write's key is indexed before its file lands, and a Get meanwhile is a miss.)
        while c.get([b"first"]) == [None] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert as_bytes(c.get([b"first", b"second"], stop_at_first_miss=False)) == [first, None]
    # Counted when the tier reads the end of the cut connection, which may come later.
    assert wait_for(lambda: tier.metric("kvtier_server_requests_total", op="DataPut", code="CANCELLED") == 1)


def test_a_put_written_through_stores_every_value_in_order_even_when_the_budget_holds_one(
    start_tier: Callable[..., TierProcess],
) -> None:
    """Written through to a lower tier, each value holds the budget until it is stored: one
    whose length is all the budget has room for is stored, and so is the next. Stores
    follow the table's order: a key named twice keeps its last value. (A store that
    overlapped the next value's receive would hold two values at once, and be refused
    here: docs/benchmarks.md, "Tried, not kept".)"""
    tier, _port = start_data_tier(
        start_tier, *WRITTEN_THROUGH, "--incoming-bytes", "8MiB", "--max-value-bytes", "6MiB"
    )
    values = [value(5 << 20, i) for i in range(5)]
    keys = [b"k", b"a", b"b", b"c", b"k"]
    with TierClient(tier.target, timeout_s=30, data_path="data") as c:
        assert c.put(list(zip(keys, values, strict=True))) == 5
        assert as_bytes(c.get([b"k", b"a", b"b", b"c"])) == [values[4], *values[1:4]]
    assert tier.metric("kvtier_tier_entries", tier="disk") == 4
    assert tier.metric("kvtier_server_requests_total", op="DataPut", code="OK") == 1


def test_garbage_bytes_get_an_error_reply_and_the_tier_keeps_serving(
    data_tier: tuple[TierProcess, int], client: TierClient
) -> None:
    _, port = data_tier
    with raw_connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _, text = read_reply(sock)
        assert status == Status.INVALID_ARGUMENT and "bad magic" in text
        assert closed_by_peer(sock, 5)
    with raw_connect(port) as sock:  # a well-formed header with an unknown op
        sock.sendall(dw.REQUEST.pack(dw.MAGIC, dw.VERSION, 9, 0, 0, 0))
        status, _, _, text = read_reply(sock)
        assert status == Status.INVALID_ARGUMENT and "unknown op 9" in text
    with raw_connect(port) as sock:  # a table that does not match its count
        sock.sendall(dw.request(Op.GET, 3, 4) + b"\x02\x00ab")
        status, _, _, text = read_reply(sock)
        assert status == Status.INVALID_ARGUMENT and "DataGet.table: ends inside key 1 of 3" in text
    with raw_connect(port) as sock:
        sock.sendall(os.urandom(100_000))
    assert client.put([(b"still", b"up")]) == 1
    assert as_bytes(client.get([b"still"])) == [b"up"]


def test_a_client_idle_or_stalled_past_the_data_timeout_is_dropped(start_tier: Callable[..., TierProcess]) -> None:
    tier, port = start_data_tier(start_tier, "--data-timeout", "1s")
    with raw_connect(port) as idle:
        assert closed_by_peer(idle, 10)
    with raw_connect(port) as stalled:
        stalled.sendall(dw.request(Op.PUT, 1, 20)[:10])  # half a header, then nothing
        assert closed_by_peer(stalled, 10)
    with TierClient(tier.target, data_path="data") as c:
        c.put([(b"k", b"v")])
        time.sleep(2)  # the tier drops the pooled connection; the client replaces it
        assert as_bytes(c.get([b"k"])) == [b"v"]
    assert tier.metric("kvtier_server_requests_total", op="DataInvalid", code="DEADLINE_EXCEEDED") == 1


def test_a_frozen_tier_costs_the_client_its_deadline_not_a_hang(data_tier: tuple[TierProcess, int]) -> None:
    tier, _ = data_tier
    with TierClient(tier.target, data_path="data", timeout_s=1) as c:
        c.put([(b"k", b"v")])
        tier.freeze()
        try:
            start = time.monotonic()
            with pytest.raises(TierUnavailable, match="DEADLINE_EXCEEDED"):
                c.get([b"k"])
            assert time.monotonic() - start < 3
        finally:
            tier.thaw()


# -- auth, isolation, TLS --------------------------------------------------------------------


def test_tenants_are_isolated_and_a_missing_or_unknown_token_is_unauthenticated(
    start_tier: Callable[..., TierProcess], tokens_dir: Path
) -> None:
    tier, port = start_data_tier(start_tier, "--auth-tokens", str(tokens_dir))
    with (
        TierClient(tier.target, token=TOKEN_A, data_path="data") as a,
        TierClient(tier.target, token=TOKEN_B, data_path="data") as b,
    ):
        a.put([(b"prefix", b"of a")])
        assert as_bytes(a.get([b"prefix"])) == [b"of a"]
        assert b.get([b"prefix"]) == [None]
        assert b.get([b"prefix"], stop_at_first_miss=False) == b.get([b"never"], stop_at_first_miss=False)
    for token in (None, "x" * 40):
        with (
            TierClient(tier.target, token=token, data_path="data") as no,
            pytest.raises(TierRejected, match="UNAUTHENTICATED"),
        ):
            no.get([b"prefix"])
    with raw_connect(port) as sock:  # no HELLO: no tenant
        sock.sendall(dw.request(Op.GET, 1, 3) + dw.get_table([b"k"]))
        status, _, _, text = read_reply(sock)
        assert status == Status.UNAUTHENTICATED and "missing 'authorization" in text
        assert closed_by_peer(sock, 5)
    with raw_connect(port) as sock:
        auth = f"Bearer {'x' * 40}".encode()
        sock.sendall(dw.request(Op.HELLO, 0, len(auth)) + auth)
        status, _, _, text = read_reply(sock)
        assert status == Status.UNAUTHENTICATED and "unknown token" in text
        assert closed_by_peer(sock, 5)
    assert tier.metric("kvtier_server_requests_total", op="DataHello", code="UNAUTHENTICATED") == 1


def test_tls_and_mutual_tls_protect_the_data_port(
    start_tier: Callable[..., TierProcess], tls_files: TlsFiles, tokens_dir: Path
) -> None:
    tier, port = start_data_tier(
        start_tier,
        "--tls-cert-file", str(tls_files.server_cert), "--tls-key-file", str(tls_files.server_key),
        "--tls-client-ca-file", str(tls_files.ca), "--auth-tokens", str(tokens_dir),
    )  # fmt: skip
    tls = {"tls_ca_file": str(tls_files.ca), "tls_cert_file": str(tls_files.client_cert),
           "tls_key_file": str(tls_files.client_key)}  # fmt: skip
    with TierClient(tier.target, token=TOKEN_A, data_path="data", **tls) as c:
        big = value(5 << 20)
        assert c.put([(b"k", big)]) == 1
        assert as_bytes(c.get([b"k"])) == [big]
    with (
        TierClient(tier.target, token=TOKEN_A, data_path="data", tls_ca_file=str(tls_files.ca), timeout_s=3) as no_cert,
        pytest.raises(TierUnavailable),
    ):
        no_cert.get([b"k"])
    with raw_connect(port) as plaintext:
        auth = f"Bearer {TOKEN_A}".encode()
        plaintext.sendall(dw.request(Op.HELLO, 0, len(auth)) + auth)
        plaintext.settimeout(5)
        try:
            data = plaintext.recv(100)
        except ConnectionResetError:
            data = b""
        assert not data.startswith(dw.MAGIC)


# -- choosing the path -------------------------------------------------------------------------


def test_auto_uses_grpc_when_the_tier_has_no_data_port(start_tier: Callable[..., TierProcess]) -> None:
    tier = start_tier(data_port=False)
    with TierClient(tier.target) as auto:
        auto.put([(b"k", b"v")])
        assert as_bytes(auto.get([b"k"])) == [b"v"]
    assert tier.metric("kvtier_server_requests_total", op="Put", code="OK") == 1
    with TierClient(tier.target, data_path="data") as data, pytest.raises(TierUnavailable, match="no data port"):
        data.get([b"k"])


def test_auto_uses_the_data_port_when_the_tier_advertises_one(data_tier: tuple[TierProcess, int]) -> None:
    tier, _ = data_tier
    with TierClient(tier.target) as auto:
        auto.put([(b"k", b"v")])
        assert as_bytes(auto.get([b"k"])) == [b"v"]
    assert tier.metric("kvtier_server_requests_total", op="DataPut", code="OK") == 1
    assert tier.metric("kvtier_server_requests_total", op="Put", code="OK") == 0


def test_auto_falls_back_to_grpc_when_the_data_port_cannot_be_reached(
    data_tier: tuple[TierProcess, int], caplog: pytest.LogCaptureFixture
) -> None:
    tier, _ = data_tier
    with TierClient(tier.target) as auto:
        auto._data_host = "127.0.0.2"  # the tier listens on 127.0.0.1 only: refused
        auto.put([(b"k", b"v")])
        assert as_bytes(auto.get([b"k"])) == [b"v"]
    assert tier.metric("kvtier_server_requests_total", op="Put", code="OK") == 1
    assert tier.metric("kvtier_server_requests_total", op="Get", code="OK") == 1
    warnings = [r for r in caplog.records if "moving values over gRPC" in r.getMessage() and r.levelname == "WARNING"]
    assert len(warnings) == 1
