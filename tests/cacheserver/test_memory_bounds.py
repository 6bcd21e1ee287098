"""What a caller can make the tier hold in memory is bounded (issue 21, items 2-4).

On real tier processes over real sockets, measured by the server's resident
memory (``VmRSS`` in /proc): unauthenticated data-port headers pin nothing,
incoming values share one server-wide budget (``--incoming-bytes``) on both
ports, stalled Put streams are cut after ``--data-timeout``, and a Get naming
one small value thousands of times does not gather them all in one buffer.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvtier.connector.client import TierClient
from kvtier.connector.errors import TierUnavailable
from kvtier.proto import SERVICE_NAME, cache_pb2, wire
from kvtier.proto import datawire as dw
from kvtier.proto.datawire import Op, Status
from kvtier.testing.tierproc import TierProcess
from tests.cacheserver.test_dataport import closed_by_peer, raw_connect, read_reply, recv_exact

MIB = 1 << 20
TOKEN = "t" * 24 + "-tenant-token"


def rss(tier: TierProcess) -> int:
    """The server's resident memory in bytes."""
    assert tier.proc is not None
    for line in Path(f"/proc/{tier.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def report(what: str, held: int) -> None:
    """The figure docs/security.md quotes (shown with ``pytest -s``)."""
    print(f"\n[memory] {what}: the server holds {held / MIB:+.1f} MiB")


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    d = tmp_path / "tokens"
    d.mkdir()
    (d / "team").write_text(TOKEN)
    return d


# -- item 2: the data port's request table ----------------------------------------------


def test_unauthenticated_data_port_headers_are_refused_before_their_table_is_allocated(
    start_tier: Callable[..., TierProcess], tokens: Path
) -> None:
    tier = start_tier("--auth-tokens", str(tokens), data_port=True)
    base = rss(tier)
    socks = [raw_connect(tier.data_port) for _ in range(8)]
    try:
        for sock in socks:  # no HELLO; a GET header that declares a 64 MiB table, and no table
            sock.sendall(dw.request(Op.GET, 1, dw.MAX_TABLE_BYTES))
        time.sleep(1)
        held = rss(tier) - base
        report("8 unauthenticated GET headers declaring 64 MiB tables", held)
        for sock in socks:
            status, _, _, text = read_reply(sock)
            assert status == Status.UNAUTHENTICATED and "missing 'authorization" in text
            assert closed_by_peer(sock, 5)
    finally:
        for sock in socks:
            sock.close()
    assert held < 32 * MIB, f"8 unauthenticated headers hold {held / MIB:.0f} MiB"


def test_a_table_longer_than_its_count_of_keys_can_fill_is_refused_before_it_is_read(
    start_tier: Callable[..., TierProcess],
) -> None:
    tier = start_tier(data_port=True)
    base = rss(tier)
    with raw_connect(tier.data_port) as sock:
        sock.sendall(dw.request(Op.GET, 2, dw.MAX_TABLE_BYTES))  # keys have a u16 length: 2 x 65537
        status, _, _, text = read_reply(sock)
        assert status == Status.RESOURCE_EXHAUSTED
        assert "DataGet.table_len: 67108864 bytes; 2 keys take at most 131074" in text
        assert closed_by_peer(sock, 5)
    held = rss(tier) - base
    report("a GET header with 2 keys declaring a 64 MiB table", held)
    assert held < 16 * MIB
    with TierClient(tier.target, data_path="data", timeout_s=30) as c:  # the tier carries on
        assert c.put([(b"k", b"v")]) == 1


# -- item 3: memory for incoming values ---------------------------------------------------


class StalledPut:
    """A gRPC Put stream that sends the first frame of a large value, then nothing until released."""

    def __init__(self, channel: grpc.Channel, key: bytes, total: int) -> None:
        self.release = threading.Event()
        self.sent = threading.Event()

        def frames() -> Iterator[bytes]:
            yield wire.encode_put_frame(key, total, 0, b"x" * 1024)
            self.sent.set()
            self.release.wait(60)

        put = channel.stream_unary(f"/{SERVICE_NAME}/Put", wire.identity, cache_pb2.PutResponse.FromString)
        self.future = put.future(frames(), timeout=60)

    def code(self, timeout_s: float) -> grpc.StatusCode | None:
        """The stream's status once it ended within ``timeout_s``; None while it is still open."""
        try:
            self.future.result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return None
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[attr-defined,no-any-return]
        return grpc.StatusCode.OK


def test_stalled_grpc_puts_of_large_values_hold_at_most_the_incoming_budget(
    start_tier: Callable[..., TierProcess],
) -> None:
    tier = start_tier("--incoming-bytes", "128MiB", "--max-value-bytes", "60MiB", "--disk-bytes", "0")
    base = rss(tier)
    with grpc.insecure_channel(tier.target) as channel:
        puts = [StalledPut(channel, b"big%d" % i, 60 * MIB) for i in range(6)]
        try:
            codes = [p.code(5) for p in puts]
            held = rss(tier) - base
            report("6 stalled gRPC Puts declaring 60 MiB each, --incoming-bytes 128MiB", held)
            assert sorted(codes, key=str) == [None, None] + [grpc.StatusCode.UNAVAILABLE] * 4, codes
            refused = [p for p in puts if p.code(0) is not None]
            assert "--incoming-bytes" in refused[0].future.exception().details()  # type: ignore[union-attr]
            assert held < (128 + 40) * MIB, f"6 stalled 60 MiB Puts hold {held / MIB:.0f} MiB"
        finally:
            for p in puts:
                p.release.set()
        for p in puts:  # ended inside their values: nothing stored, the budget given back
            assert p.code(10) in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE)
    with TierClient(tier.target, data_path="grpc", timeout_s=30) as c:
        assert c.put([(b"after", os.urandom(50 * MIB))]) == 1
        assert c.lookup([b"big0", b"big1"]) == 0


def test_a_stalled_grpc_put_stream_is_cut_after_the_data_timeout_and_frees_its_budget(
    start_tier: Callable[..., TierProcess],
) -> None:
    tier = start_tier("--data-timeout", "1s", "--incoming-bytes", "64MiB", "--max-value-bytes", "60MiB")
    with grpc.insecure_channel(tier.target) as channel:
        stalled = StalledPut(channel, b"stalled", 60 * MIB)
        try:
            assert stalled.code(10) == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "--data-timeout" in stalled.future.exception().details()  # type: ignore[union-attr]
        finally:
            stalled.release.set()
    with TierClient(tier.target, data_path="grpc", timeout_s=30) as c:
        assert c.put([(b"after", os.urandom(50 * MIB))]) == 1
        assert c.lookup([b"stalled"]) == 0
    assert tier.metric("kvtier_server_requests_total", op="Put", code="DEADLINE_EXCEEDED") == 1


def test_stalled_data_port_puts_hold_at_most_the_incoming_budget(
    start_tier: Callable[..., TierProcess],
) -> None:
    tier = start_tier(
        "--incoming-bytes", "128MiB", "--max-value-bytes", "60MiB", "--disk-bytes", "0", data_port=True
    )
    base = rss(tier)
    socks, statuses = [], []
    try:
        for i in range(6):
            sock = raw_connect(tier.data_port)
            socks.append(sock)
            table = dw.put_table([(b"big%d" % i, 60 * MIB)])
            sock.sendall(dw.request(Op.PUT, 1, len(table)) + table)
            status, _, _, text = read_reply(sock)
            statuses.append(status)
            if status == Status.OK:
                sock.sendall(b"x" * 1024)  # then nothing
            else:
                assert "--incoming-bytes" in text
        time.sleep(1)
        held = rss(tier) - base
        report("6 stalled data-port PUTs declaring 60 MiB each, --incoming-bytes 128MiB", held)
        assert statuses == [Status.OK] * 2 + [Status.UNAVAILABLE] * 4
        assert held < (128 + 40) * MIB, f"6 stalled 60 MiB Puts hold {held / MIB:.0f} MiB"
        with (  # refused at once: retryable
            TierClient(tier.target, data_path="data", timeout_s=30) as c,
            pytest.raises(TierUnavailable, match=r"UNAVAILABLE: .*--incoming-bytes"),
        ):
            c.put([(b"refused", os.urandom(10 * MIB))])
    finally:
        for sock in socks:
            sock.close()
    deadline = time.monotonic() + 10
    # The cut connections gave their bytes back.
    with TierClient(tier.target, data_path="data", timeout_s=30) as c:
        while True:
            try:
                assert c.put([(b"after", os.urandom(50 * MIB))]) == 1
                break
            except TierUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def test_a_data_port_put_refused_by_the_budget_midway_keeps_the_values_before_it(
    start_tier: Callable[..., TierProcess],
) -> None:
    tier = start_tier("--incoming-bytes", "64MiB", "--max-value-bytes", "40MiB", data_port=True)
    first, second = os.urandom(8 * MIB), os.urandom(40 * MIB)
    with raw_connect(tier.data_port) as hog:  # holds 40 MiB of the 64
        table = dw.put_table([(b"hog", 40 * MIB)])
        hog.sendall(dw.request(Op.PUT, 1, len(table)) + table)
        assert read_reply(hog)[0] == Status.OK
        hog.sendall(b"x")
        with raw_connect(tier.data_port) as sock:
            table = dw.put_table([(b"first", len(first)), (b"second", len(second))])
            sock.sendall(dw.request(Op.PUT, 2, len(table)) + table)
            assert read_reply(sock)[0] == Status.OK
            sock.sendall(first + second)  # the server reads (and drops) the second value's bytes
            status, count, _, text = read_reply(sock)
            assert status == Status.UNAVAILABLE and "DataPut.values[1]" in text
            assert count == 1  # the first value was stored
    with TierClient(tier.target, data_path="data", timeout_s=30) as c:
        got = c.get([b"first", b"second"], stop_at_first_miss=False)
        assert got[1] is None and got[0] is not None and bytes(got[0]) == first


# -- item 4: Get amplification ----------------------------------------------------------------


def test_a_get_naming_one_small_value_thousands_of_times_gathers_no_large_reply(
    start_tier: Callable[..., TierProcess],
) -> None:
    tier = start_tier(data_port=True)
    small = os.urandom(60 << 10)
    with TierClient(tier.target, data_path="data", timeout_s=30) as c:
        c.put([(b"small", small)])
    base = rss(tier)
    keys = [b"small"] * 4096
    table = dw.get_table(keys)
    with raw_connect(tier.data_port) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.sendall(dw.request(Op.GET, len(keys), len(table)) + table)
        assert read_reply(sock)[:2] == (Status.OK, 4096)
        recv_exact(sock, dw.ENTRY.size + len(small))
        time.sleep(2)  # the client reads no more: the server's sends block
        held = rss(tier) - base
        report("a data-port GET naming one 60 KiB value 4096 times", held)
    assert held < 32 * MIB, f"one 60 KiB value named 4096 times holds {held / MIB:.0f} MiB"


def test_a_value_whose_get_client_reset_the_connection_is_freed_without_a_garbage_collection(
    start_tier: Callable[..., TierProcess],
) -> None:
    tier = start_tier(data_port=True)
    big = os.urandom(48 * MIB)
    with TierClient(tier.target, data_path="data", timeout_s=30) as c:
        c.put([(b"big", big)])
    base = rss(tier)
    for _ in range(2):
        table = dw.get_table([b"big"])
        with raw_connect(tier.data_port) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            sock.sendall(dw.request(Op.GET, 1, len(table)) + table)
            read_reply(sock)  # then the server's send of the value blocks: nobody reads
            with TierClient(tier.target, data_path="grpc", timeout_s=30) as other:
                for _ in range(1500):  # the server lives on: its young objects age (gc generations)
                    other.lookup([b"big"])
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        time.sleep(0.5)  # the reset fails the server's send
        # The old value's buffer is only referenced by the failed send now.
        with TierClient(tier.target, data_path="data", timeout_s=30) as c:
            c.delete([b"big"])
            c.put([(b"big", big)])
    time.sleep(1)
    held = rss(tier) - base
    report("2 data-port GETs of a 48 MiB value whose clients reset the connection", held)
    assert held < 40 * MIB, f"values of 2 Gets whose clients left still hold {held / MIB:.0f} MiB"
