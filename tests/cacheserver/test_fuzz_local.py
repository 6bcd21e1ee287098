"""A bounded fuzz run over the same-node transport's control messages (``kvtier.proto.localwire``).

Requests that are almost right (real magic, version and ops with random flags, counts,
tables and lengths, tables of real key, PUT-item and RESERVE-item records with random fields) and
random bytes, each on a fresh connection that then ends its sending side. Every reply
must carry a status from the contract (never INTERNAL), and the tier must stay up with
no unhandled exception in its log. CI runs a bounded number of examples; a longer run
is ``KVTIER_FUZZ_EXAMPLES=20000 scripts/test tests/cacheserver/test_fuzz_local.py``.
"""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.connector.client import TierClient
from kvtier.proto import localwire as lw
from kvtier.proto.localwire import Op, Status
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.waits import wait_for

EXAMPLES = int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "150"))
ALLOWED = {
    Status.OK,
    Status.INVALID_ARGUMENT,
    Status.RESOURCE_EXHAUSTED,
    Status.UNAVAILABLE,
    Status.UNAUTHENTICATED,  # an authorization value that is not UTF-8
}


@pytest.fixture(scope="module")
def fuzz_tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TierProcess]:
    tier = TierProcess.start(
        tmp_path_factory.mktemp("fuzz-local"),
        "--max-value-bytes", "1MiB", "--incoming-bytes", "4MiB", "--max-keys", "64",
        # k2 fits no RAM tier of 200 KiB: it lives on disk only, and a GET that sets
        # FLAG_FILES is answered with its record file
        "--ram-bytes", "200KiB", "--write-policy", "write-through",
        local_socket=True,
    )  # fmt: skip
    with TierClient(tier.target, local_socket=tier.local_socket, data_path="local") as c:
        c.put([(b"k%d" % i, os.urandom(n)) for i, n in enumerate((10, 70_000, 300_000))])
    yield tier
    tier.stop()


def exchange(path: str, data: bytes) -> list[int]:
    """Sends ``data`` on a fresh connection, ends the sending side, and returns the status of
    every reply header found in what comes back (replies of ops that answer with a body are
    not walked past: the first header is what the contract speaks about)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the tier closed first (a stream it could not parse)
        received = b""
        while True:
            try:
                chunk, ancillary, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(lw.MAX_FDS * 4))
            except ConnectionResetError:
                break
            for level, kind, fds in ancillary:  # segments and record files handed over
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                    for fd in array.array("i", fds[: len(fds) - len(fds) % 4]):
                        os.close(fd)
            if not chunk:
                break
            received += chunk
    statuses = []
    if len(received) >= lw.REPLY.size:
        magic, version, _op, status, _count, _extra, _text = lw.REPLY.unpack_from(received)
        assert (magic, version) == (lw.MAGIC, lw.VERSION)
        statuses.append(status)
    return statuses


keys = st.lists(st.one_of(st.sampled_from([b"k0", b"k1", b"k2"]), st.binary(max_size=300)), max_size=5)
key_table = keys.map(lambda ks: lw.key_table([k[:0xFFFF] for k in ks]))
put_items = st.lists(
    st.tuples(
        st.binary(max_size=300),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**64 - 1),
    ),
    max_size=4,
).map(lambda items: lw.put_table(items))
reserve_items = st.lists(
    st.one_of(st.integers(0, 2 << 20), st.integers(0, 2**64 - 1)), max_size=6
).map(lambda sizes: b"".join(lw.RESERVE_ITEM.pack(n) for n in sizes))
table = st.one_of(
    key_table, put_items, reserve_items, st.binary(max_size=64), st.integers(0, 2**64 - 1).map(lw.STAGE.pack)
)
request = st.builds(
    lambda op, flags, count, body, declared: lw.REQUEST.pack(
        lw.MAGIC, lw.VERSION, op, flags, count, len(body) if declared is None else declared
    )
    + body,
    op=st.one_of(st.sampled_from(list(Op)), st.integers(0, 255)),
    flags=st.integers(0, 0xFFFF),
    count=st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)),
    body=table,
    declared=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
)
hello = lw.request(Op.HELLO, 0, 0)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=1, max_size=3), greet=st.booleans())
def test_random_control_messages_get_a_contract_status(
    fuzz_tier: TierProcess, requests: list[bytes], greet: bool
) -> None:
    data = (hello if greet else b"") + b"".join(requests)
    for status in exchange(fuzz_tier.local_socket, data):
        assert status in ALLOWED


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(64 << 10, 1 << 20), min_size=1, max_size=3),
    items=st.lists(
        st.tuples(
            st.binary(max_size=40),
            st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1)),
            st.one_of(st.integers(64 << 10, 1 << 20), st.integers(0, 2**64 - 1)),
            st.integers(0, 2**64 - 1),
        ),
        max_size=4,
    ),
    count=st.one_of(st.none(), st.integers(0, 8)),
)
def test_random_puts_into_real_reservations_get_a_contract_status(
    fuzz_tier: TierProcess, sizes: list[int], items: list[tuple[bytes, int, int, int]], count: int | None
) -> None:
    """A real RESERVE, then a PUT with ``FLAG_RESERVED`` whose items name random
    reservations, lengths and checksums: both replies carry a contract status."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(fuzz_tier.local_socket)
        reserve = b"".join(lw.RESERVE_ITEM.pack(n) for n in sizes)
        sock.sendall(hello + lw.request(Op.RESERVE, len(sizes), len(reserve)) + reserve)
        received, fds = _receive_until(sock, 2)
        for fd in fds:
            os.close(fd)
        put = lw.put_table(items)
        n = len(items) if count is None else count
        sock.sendall(lw.request(Op.PUT, n, len(put), lw.FLAG_RESERVED) + put)
        sock.shutdown(socket.SHUT_WR)
        more, fds = _receive_until(sock, 1)
        for fd in fds:
            os.close(fd)
    statuses = [status for status, _ in received] + [status for status, _ in more]
    assert statuses and all(status in ALLOWED for status in statuses), statuses


def _receive_until(sock: socket.socket, replies: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Reads ``replies`` reply headers (with a RESERVE's body) or until the tier closes:
    their (status, op), and the descriptors that came with them."""
    buf, fds, out = b"", [], []
    while len(out) < replies:
        while True:
            if len(buf) >= lw.REPLY.size:
                _m, _v, op, status, count, extra, text_len = lw.REPLY.unpack_from(buf)
                body = extra * lw.SEGMENT.size + count * lw.PLACE.size if op == Op.RESERVE and status == 0 else 0
                if len(buf) >= lw.REPLY.size + text_len + body:
                    break
            try:
                chunk, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(lw.MAX_FDS * 4))
            except ConnectionResetError:
                chunk, ancillary = b"", []
            for level, kind, data in ancillary:
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                    fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
            if not chunk:
                return out, fds
            buf += chunk
        out.append((status, op))
        buf = buf[lw.REPLY.size + text_len + body :]
    return out, fds


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200))
def test_random_bytes_get_a_contract_status(fuzz_tier: TierProcess, data: bytes) -> None:
    for status in exchange(fuzz_tier.local_socket, data):
        assert status in ALLOWED


def test_the_tier_survived_the_fuzz_without_an_unhandled_exception(fuzz_tier: TierProcess) -> None:
    with TierClient(fuzz_tier.target, local_socket=fuzz_tier.local_socket, data_path="local") as c:
        assert c.lookup([b"k0", b"k1", b"k2"]) == 3
        assert [v is not None for v in c.get([b"k0", b"k1", b"k2"])] == [True, True, True]
    log = fuzz_tier.log.read_text()
    assert "Traceback" not in log and "internal error" not in log
    metrics = fuzz_tier.metrics()
    assert 'code="INTERNAL"' not in metrics
    # The tier ends a closed connection, and closes a reply's record files, just after the
    # client is done with it: each is waited for, within a bound.
    assert wait_for(lambda: fuzz_tier.metric("kvtier_server_incoming_bytes") == 0, 10)  # staging went with its connection
    assert wait_for(lambda: fuzz_tier.metric("kvtier_local_leased_bytes") == 0, 10)
    assert wait_for(lambda: len(os.listdir(f"/proc/{fuzz_tier.proc.pid}/fd")) < 100, 10)  # record files were closed
