"""Authentication, tenant isolation, quotas and TLS on a real tier process."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from kvtier.connector.client import TierClient
from kvtier.connector.errors import TierRejected, TierUnavailable
from kvtier.proto import SERVICE_NAME, cache_pb2
from kvtier.testing.redisprocs import TlsFiles
from kvtier.testing.tierproc import TierProcess

TOKEN_A = "a" * 24 + "-tenant-a-token"
TOKEN_B = "b" * 24 + "-tenant-b-token"


@pytest.fixture
def tokens_dir(tmp_path: Path) -> Path:
    """Tokens laid out as a mounted Kubernetes Secret: one file per tenant."""
    d = tmp_path / "tokens"
    d.mkdir()
    (d / "team-a").write_text(TOKEN_A + "\n")
    (d / "team-b").write_text(TOKEN_B)
    (d / "..data").mkdir()  # what a Secret volume also contains
    return d


@pytest.fixture
def secured(start_tier: Callable[..., TierProcess], tokens_dir: Path) -> TierProcess:
    return start_tier("--auth-tokens", str(tokens_dir))


def _code(exc: pytest.ExceptionInfo[Exception]) -> grpc.StatusCode:
    cause = exc.value.__cause__
    assert isinstance(cause, grpc.Call)
    return cause.code()


def test_a_call_without_a_token_is_unauthenticated(secured: TierProcess) -> None:
    with TierClient(secured.target) as c, pytest.raises(TierRejected, match="missing 'authorization") as exc:
        c.lookup([b"k"])
    assert _code(exc) == grpc.StatusCode.UNAUTHENTICATED


def test_a_call_with_an_unknown_token_is_unauthenticated_and_stores_nothing(secured: TierProcess) -> None:
    with TierClient(secured.target, token="x" * 40) as c, pytest.raises(TierRejected, match="unknown token") as exc:
        c.put([(b"k", b"v")])
    assert _code(exc) == grpc.StatusCode.UNAUTHENTICATED
    with TierClient(secured.target, token=TOKEN_A) as a:
        assert a.lookup([b"k"]) == 0


def test_the_same_tenant_hits_and_another_tenant_misses_the_same_key(secured: TierProcess) -> None:
    data = os.urandom(5000)
    with TierClient(secured.target, token=TOKEN_A) as a, TierClient(secured.target, token=TOKEN_B) as b:
        a.put([(b"prompt-prefix", data)])
        assert a.lookup([b"prompt-prefix"]) == 1  # caching works for the owner...
        (got,) = a.get([b"prompt-prefix"])
        assert got is not None and bytes(got) == data
        assert b.lookup([b"prompt-prefix"]) == 0  # ...and is invisible to anybody else
        assert b.get([b"prompt-prefix"]) == [None]
        assert b.delete([b"prompt-prefix"]) == 0
        assert a.lookup([b"prompt-prefix"]) == 1, "b's delete did not touch a's entry"
        assert a.stats().tenant == "team-a" and b.stats().tenant == "team-b"


def test_a_foreign_key_answers_exactly_as_a_key_nobody_wrote(secured: TierProcess) -> None:
    with TierClient(secured.target, token=TOKEN_A) as a, TierClient(secured.target, token=TOKEN_B) as b:
        a.put([(b"secret", b"v")])
        assert b.get([b"secret"], stop_at_first_miss=False) == b.get([b"never"], stop_at_first_miss=False)
        assert b.lookup([b"secret"]) == b.lookup([b"never"]) == 0


def test_forged_tenant_metadata_is_ignored(secured: TierProcess) -> None:
    with TierClient(secured.target, token=TOKEN_A) as a:
        a.put([(b"k", b"v")])
    with grpc.insecure_channel(secured.target) as ch:
        lookup = ch.unary_unary(f"/{SERVICE_NAME}/Lookup", request_serializer=cache_pb2.LookupRequest.SerializeToString,
                                response_deserializer=cache_pb2.LookupResponse.FromString)  # fmt: skip
        md = (("authorization", f"Bearer {TOKEN_B}"), ("x-kvtier-tenant", "team-a"), ("tenant", "team-a"))
        assert lookup(cache_pb2.LookupRequest(keys=[b"k"]), metadata=md, timeout=5).prefix_length == 0


def test_health_stays_open_without_a_token(secured: TierProcess) -> None:
    from grpc_health.v1 import health_pb2

    from kvtier.testing.tierproc import health_status

    assert health_status(secured.target) == health_pb2.HealthCheckResponse.SERVING


def test_a_rotated_token_file_takes_effect_without_a_restart(secured: TierProcess, tokens_dir: Path) -> None:
    new = "n" * 30
    (tokens_dir / "team-a").write_text(new)

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with TierClient(secured.target, token=new) as c:
            try:
                c.lookup([b"k"])
                break
            except TierRejected:
                time.sleep(0.5)
    else:
        pytest.fail("the new token was never accepted")
    with TierClient(secured.target, token=TOKEN_A) as old, pytest.raises(TierRejected):
        old.lookup([b"k"])


def test_a_short_token_stops_the_server_with_a_message(start_tier: Callable[..., TierProcess], tmp_path: Path) -> None:
    f = tmp_path / "tokens.txt"
    f.write_text("# tenant token\nteam-a short\n")
    with pytest.raises(RuntimeError, match="shorter than 16 characters"):
        start_tier("--auth-tokens", str(f))


def test_one_tenants_load_never_evicts_another_tenants_entries_within_quotas(
    start_tier: Callable[..., TierProcess], tokens_dir: Path
) -> None:
    tier = start_tier(
        "--auth-tokens", str(tokens_dir), "--ram-bytes", "2MiB", "--tenant-quota-bytes", "1MiB", "--disk-bytes", "0"
    )
    with TierClient(tier.target, token=TOKEN_A) as a, TierClient(tier.target, token=TOKEN_B) as b:
        b.put([(b"b%d" % i, os.urandom(100_000)) for i in range(5)])
        for i in range(40):  # 4 MB from tenant a: twice the whole tier
            a.put([(b"a%d" % i, os.urandom(100_000))])
        assert b.lookup([b"b%d" % i for i in range(5)]) == 5
        assert a.lookup([b"a39"]) == 1 and a.lookup([b"a0"]) == 0


def test_tls_and_mutual_tls_protect_the_tier(
    start_tier: Callable[..., TierProcess], tls_files: TlsFiles, tokens_dir: Path
) -> None:
    tier = start_tier(
        "--tls-cert-file", str(tls_files.server_cert), "--tls-key-file", str(tls_files.server_key),
        "--tls-client-ca-file", str(tls_files.ca), "--auth-tokens", str(tokens_dir),
    )  # fmt: skip
    with TierClient(tier.target, token=TOKEN_A, tls_ca_file=str(tls_files.ca),
                    tls_cert_file=str(tls_files.client_cert), tls_key_file=str(tls_files.client_key)) as c:  # fmt: skip
        c.put([(b"k", b"over tls")])
        (got,) = c.get([b"k"])
        assert got is not None and bytes(got) == b"over tls"
    with (
        TierClient(tier.target, token=TOKEN_A, tls_ca_file=str(tls_files.ca), timeout_s=2) as no_cert,
        pytest.raises(TierUnavailable),
    ):
        no_cert.lookup([b"k"])
    with TierClient(tier.target, token=TOKEN_A, timeout_s=2) as plaintext, pytest.raises(TierUnavailable):
        plaintext.lookup([b"k"])
