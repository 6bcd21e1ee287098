"""Tenant probes on every transport (issue 21, item 5), on a real tier process.

Tenant B probes tenant A's chunks with A's keys, with forged cache salts and
forged tenants, over gRPC (Lookup, Get) and the data port (GET): no probe hits,
and every answer is byte for byte the answer to keys nobody wrote. The harness
is kvtier/bench/probes.py; ``kvtier bench probes`` prints the latency
distributions side by side (docs/security.md), which no test asserts.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.bench import probes
from kvtier.proto import datawire as dw
from kvtier.proto.datawire import Op, Status
from kvtier.testing.tierproc import TierProcess

ROUNDS = 12


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TierProcess, probes.Results]]:
    directory = tmp_path_factory.mktemp("probes")
    tokens = directory / "tokens"
    tokens.mkdir()
    for tenant, token in probes.TOKENS.items():
        (tokens / tenant).write_text(token)
    tier = TierProcess.start(Path(directory) / "tier", "--auth-tokens", str(tokens))
    try:
        yield tier, probes.run(tier, ROUNDS)
    finally:
        tier.stop()


@pytest.mark.parametrize("transport", probes.TRANSPORTS)
def test_the_owner_hits_its_own_chunks(results: tuple[TierProcess, probes.Results], transport: str) -> None:
    assert results[1].hits(transport, "own") == ROUNDS * probes.CHUNKS  # the probes can see a hit


@pytest.mark.parametrize("transport", probes.TRANSPORTS)
@pytest.mark.parametrize("kind", ["foreign", "forged-salt", "forged-tenant"])
def test_no_cross_tenant_probe_hits(
    results: tuple[TierProcess, probes.Results], transport: str, kind: str
) -> None:
    assert results[1].hits(transport, kind) == 0


@pytest.mark.parametrize("transport", probes.TRANSPORTS)
@pytest.mark.parametrize("kind", ["foreign", "forged-salt", "forged-tenant"])
def test_a_foreign_entry_answers_byte_for_byte_as_an_absent_one(
    results: tuple[TierProcess, probes.Results], transport: str, kind: str
) -> None:
    assert results[1].shapes(transport, kind) == results[1].shapes(transport, "absent")
    assert len(results[1].shapes(transport, "absent")) == 1


def test_a_tenant_named_beside_a_token_in_the_data_port_hello_is_unauthenticated(
    results: tuple[TierProcess, probes.Results],
) -> None:
    tier = results[0]
    for value in (f"Bearer {probes.TOKENS['team-b']} team-a", "Bearer team-a", "team-a"):
        with socket.create_connection(("127.0.0.1", tier.data_port), timeout=10) as sock:
            sock.sendall(dw.request(Op.HELLO, 0, len(value)) + value.encode())
            reply = probes.read_reply(sock)
            assert dw.REPLY.unpack(reply[: dw.REPLY.size])[3] == Status.UNAUTHENTICATED
            assert b"team-a" not in reply[dw.REPLY.size :]
