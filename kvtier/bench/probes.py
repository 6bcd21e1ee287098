"""Tenant probes on every transport: can tenant B see tenant A's chunks, over gRPC or the data port?

    kvtier bench probes [--rounds 300]

Starts a ``kvtier server`` with two tenants (``team-a``, ``team-b``) and the data
port on. Tenant A stores the chunks of a prompt, keyed as the connector keys
them (``KeyChain`` with A's ``cache_salt``). Tenant B then probes, over gRPC
(``Lookup`` and ``Get``) and over the data port (``GET``), with:

- ``foreign``: A's exact keys (B forged A's cache salt, or learned the keys);
- ``forged-salt``: the keys of the same prompt under salts B guesses;
- ``forged-tenant``: A's keys inside A's namespace prefix (``len || "team-a" ||
  key``), and, over gRPC, A's keys with forged tenant metadata beside B's token;
- ``absent``: keys nobody wrote (the reference miss);
- ``own`` (control, tenant A): A's keys, which must hit.

Every probe records whether anything hit, the exact bytes of the answer with the
key-dependent parts left as they are (a foreign entry must answer byte for byte as
an absent one), and its latency. Rounds interleave the kinds so drift hits all of
them alike. Prints the hits and one latency distribution per transport and kind
(p10/p50/p90/p99, ms), side by side. ``tests/cacheserver/test_tenant_probes.py``
runs the same probes with a few rounds and asserts the hits and shapes; the
latencies are measured here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvtier.cacheserver.namespace import scoped
from kvtier.connector.client import TierClient
from kvtier.connector.keys import KeyChain, KeySpec
from kvtier.proto import SERVICE_NAME, cache_pb2, wire
from kvtier.proto import datawire as dw
from kvtier.proto.datawire import Op
from kvtier.testing.tierproc import TierProcess

TOKENS = {"team-a": "a" * 24 + "-probe-tenant-a", "team-b": "b" * 24 + "-probe-tenant-b"}
SPEC = KeySpec(model_id="probe/model", chunk_size=256, block_size=16)
CHUNKS = 4
CHUNK_BYTES = 128 << 10
KINDS = ("own", "foreign", "forged-salt", "forged-tenant", "absent")
TRANSPORTS = ("grpc Lookup", "grpc Get", "data GET")


@dataclass(frozen=True)
class Answer:
    hits: int
    shape: bytes  # the answer's bytes (frames or reply), to compare kinds
    seconds: float


@dataclass
class Results:
    """Per (transport, kind): the answers of every round."""

    answers: dict[tuple[str, str], list[Answer]] = field(default_factory=dict)

    def add(self, transport: str, kind: str, answer: Answer) -> None:
        self.answers.setdefault((transport, kind), []).append(answer)

    def hits(self, transport: str, kind: str) -> int:
        return sum(a.hits for a in self.answers[(transport, kind)])

    def shapes(self, transport: str, kind: str) -> set[bytes]:
        return {a.shape for a in self.answers[(transport, kind)]}


def chain_keys(tokens: list[int], salt: str) -> list[bytes]:
    chain = KeyChain(SPEC, cache_salt=salt)
    chain.extend(tokens)
    return list(chain.keys)


def store_prompt(tier: TierProcess, tokens: list[int]) -> list[bytes]:
    """Tenant A stores its prompt's chunks; returns their keys."""
    keys = chain_keys(tokens, "salt-of-a")
    with TierClient(tier.target, token=TOKENS["team-a"], timeout_s=30) as a:
        assert a.put([(k, os.urandom(CHUNK_BYTES)) for k in keys]) == len(keys)
    return keys


class GrpcProbe:
    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self._get = self.channel.unary_stream(f"/{SERVICE_NAME}/Get", wire.identity, wire.identity)
        self._lookup = self.channel.unary_unary(f"/{SERVICE_NAME}/Lookup", wire.identity, wire.identity)

    def close(self) -> None:
        self.channel.close()

    def get(self, tenant: str, keys: list[bytes], forged: Sequence[tuple[str, str]] = ()) -> Answer:
        metadata = [("authorization", f"Bearer {TOKENS[tenant]}"), *forged]
        request = cache_pb2.GetRequest(keys=keys, stop_at_first_miss=False).SerializeToString()
        start = time.perf_counter()
        frames = list(self._get(request, metadata=metadata, timeout=30))
        seconds = time.perf_counter() - start
        hits = sum(1 for f in frames if wire.decode_get_frame(f).found)
        shape = b"".join(f for f in frames if not wire.decode_get_frame(f).found)
        return Answer(hits, shape if not hits else b"hit", seconds)

    def lookup(
        self, tenant: str, keys: list[bytes], forged: Sequence[tuple[str, str]] = ()
    ) -> Answer:
        metadata = [("authorization", f"Bearer {TOKENS[tenant]}"), *forged]
        request = cache_pb2.LookupRequest(keys=keys).SerializeToString()
        start = time.perf_counter()
        reply = self._lookup(request, metadata=metadata, timeout=30)
        seconds = time.perf_counter() - start
        return Answer(cache_pb2.LookupResponse.FromString(reply).prefix_length, reply, seconds)


class DataProbe:
    """One raw data-port connection per tenant, HELLO sent once."""

    def __init__(self, port: int) -> None:
        self.socks: dict[str, socket.socket] = {}
        for tenant, token in TOKENS.items():
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth = f"Bearer {token}".encode()
            sock.sendall(dw.request(Op.HELLO, 0, len(auth)) + auth)
            read_reply(sock)
            self.socks[tenant] = sock

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()

    def get(self, tenant: str, keys: list[bytes]) -> Answer:
        sock = self.socks[tenant]
        table = dw.get_table(keys)
        start = time.perf_counter()
        sock.sendall(dw.request(Op.GET, len(keys), len(table)) + table)
        head = read_reply(sock)
        hits, entries = 0, b""
        for _ in range(dw.REPLY.unpack(head[: dw.REPLY.size])[4]):
            entry = recv_exact(sock, dw.ENTRY.size)
            found, n = dw.ENTRY.unpack(entry)
            if found:
                hits += 1
                recv_exact(sock, n)
            entries += entry
        seconds = time.perf_counter() - start
        return Answer(hits, head + entries if not hits else b"hit", seconds)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the tier closed the data connection")
        got += k
    return bytes(buf)


def read_reply(sock: socket.socket) -> bytes:
    head = recv_exact(sock, dw.REPLY.size)
    return head + recv_exact(sock, dw.REPLY.unpack(head)[6])


def run(tier: TierProcess, rounds: int, seed: int = 0) -> Results:
    """Stores A's prompt, then probes ``rounds`` times per transport and kind."""
    rng = random.Random(seed)
    tokens = [rng.randrange(1, 32000) for _ in range(CHUNKS * SPEC.chunk_size)]
    keys_a = store_prompt(tier, tokens)
    in_a_namespace = [scoped("team-a", k) for k in keys_a]
    forged_metadata = [("tenant", "team-a"), ("x-kvtier-tenant", "team-a")]
    results = Results()
    g, d = GrpcProbe(tier.target), DataProbe(tier.data_port)
    try:
        for r in range(rounds):
            guessed = chain_keys(tokens, ("", "salt-of-b", "salt-of-a ", "SALT-OF-A")[r % 4])
            absent = [os.urandom(SPEC.key_size) for _ in keys_a]
            order = list(KINDS)
            rng.shuffle(order)
            for kind in order:
                if kind == "own":
                    answers = (g.lookup("team-a", keys_a), g.get("team-a", keys_a), d.get("team-a", keys_a))
                elif kind == "foreign":
                    answers = (g.lookup("team-b", keys_a), g.get("team-b", keys_a), d.get("team-b", keys_a))
                elif kind == "forged-salt":
                    answers = (g.lookup("team-b", guessed), g.get("team-b", guessed), d.get("team-b", guessed))
                elif kind == "forged-tenant":
                    answers = (
                        g.lookup("team-b", keys_a, forged_metadata),
                        g.get("team-b", in_a_namespace if r % 2 else keys_a, forged_metadata),
                        d.get("team-b", in_a_namespace),
                    )
                else:
                    answers = (g.lookup("team-b", absent), g.get("team-b", absent), d.get("team-b", absent))
                for transport, answer in zip(TRANSPORTS, answers, strict=True):
                    results.add(transport, kind, answer)
    finally:
        g.close()
        d.close()
    return results


def table(results: Results) -> str:
    lines = [
        "| transport | probe | hits | p10 ms | p50 ms | p90 ms | p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for transport, kind in sorted(results.answers, key=lambda tk: (TRANSPORTS.index(tk[0]), KINDS.index(tk[1]))):
        ms = sorted(a.seconds * 1000 for a in results.answers[(transport, kind)])
        q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
        lines.append(
            f"| {transport} | {kind} | {results.hits(transport, kind)} | "
            f"{q[9]:.3f} | {q[49]:.3f} | {q[89]:.3f} | {q[98]:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvtier bench probes", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=300, help="probes per transport and kind")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tokens = Path(d) / "tokens"
        tokens.mkdir()
        for tenant, token in TOKENS.items():
            (tokens / tenant).write_text(token)
        tier = TierProcess.start(Path(d) / "tier", "--auth-tokens", str(tokens))
        try:
            results = run(tier, a.rounds)
        finally:
            tier.stop()
    print(f"{a.rounds} rounds; {CHUNKS} chunks of {CHUNK_BYTES >> 10} KiB stored by team-a; "
          "every other probe is team-b's\n")  # fmt: skip
    print(table(results))
    for transport in TRANSPORTS:
        same = all(
            results.shapes(transport, kind) == results.shapes(transport, "absent")
            for kind in ("foreign", "forged-salt", "forged-tenant")
        )
        print(f"\n{transport}: foreign answers byte for byte as absent ones: {'yes' if same else 'NO'}")
    return 0
