"""The chart's containers' commands, run for real on this machine.

The helm test's health check runs against a real ``kvtier server``; the
in-chart Redis's start-up script against Debian's ``redis-server``; and every
``kvtier_*`` metric the dashboards and alerts query is one a real tier exports.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from kvtier.testing.redisprocs import TlsFiles, free_port
from kvtier.testing.tierproc import TierProcess
from tests.helm.conftest import CHART, Helm


def only_container(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    spec = obj["spec"] if kind == "Pod" else obj["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return container


def health_check_command(
    helm: Helm, target: str, timeout_s: str, values: Path | None = None
) -> list[str]:
    """The helm test pod's command, aimed at ``target`` (it runs `python -c SCRIPT TARGET
    TIMEOUT [TLS FILES]`; the files stay the pod's paths)."""
    objects = helm.template(*([values] if values else []))
    container = only_container(objects, "Pod", "kvtier-test-tier-health")
    assert container["command"] == ["python", "-c"]
    script, pod_target, _, *tls_files = container["args"]
    assert pod_target == "kvtier.kvtier.svc:50051"
    return [sys.executable, "-c", script, target, timeout_s, *tls_files]


def test_the_helm_test_passes_when_the_tier_is_serving(helm: Helm, tier: TierProcess) -> None:
    result = subprocess.run(
        health_check_command(helm, tier.target, "10"), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"the kvtier tier at {tier.target} is SERVING" in result.stdout


def test_the_helm_test_checks_a_mutual_tls_tier_with_the_secrets_it_mounts(
    helm: Helm, start_tier: Callable[..., TierProcess], tmp_path: Path
) -> None:
    files = TlsFiles.generate(tmp_path / "pki")
    values = tmp_path / "values.yaml"
    values.write_text(
        "defaultTier: {tls: {secretName: tier-tls, clientAuth: true, testClientSecretName: test-tls}}\n"
    )
    pod = next(
        o for o in helm.template(values) if o["kind"] == "Pod" and o["metadata"]["name"] == "kvtier-test-tier-health"
    )["spec"]
    (container,) = pod["containers"]
    # What the kubelet mounts: only ca.crt of the tier's Secret, the test Secret's pair.
    secrets = {
        "tier-tls": {"ca.crt": files.ca},
        "test-tls": {"tls.crt": files.client_cert, "tls.key": files.client_key},
    }
    paths = {}
    for volume in pod["volumes"]:
        mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
        for item in volume["secret"]["items"]:
            source = secrets[volume["secret"]["secretName"]][item["key"]]
            paths[f"{mount['mountPath']}/{item['path']}"] = str(source)
    tier = start_tier(
        "--tls-cert-file", str(files.server_cert), "--tls-key-file", str(files.server_key),
        "--tls-client-ca-file", str(files.ca),
    )  # fmt: skip
    command = health_check_command(helm, tier.target, "10", values)
    assert command[5:] == [
        "/etc/kvtier/tls/ca.crt", "/etc/kvtier/client-tls/tls.crt", "/etc/kvtier/client-tls/tls.key",
    ]  # fmt: skip
    result = subprocess.run(
        command[:5] + [paths[path] for path in command[5:]], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"the kvtier tier at {tier.target} is SERVING" in result.stdout
    # The same check without the client certificate is refused by the tier.
    without_certificate = [*command[:4], "1", paths[command[5]]]
    result = subprocess.run(without_certificate, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "is not SERVING after 1 s: UNAVAILABLE" in result.stdout


def test_the_helm_test_fails_naming_the_error_when_no_tier_answers(helm: Helm) -> None:
    target = f"127.0.0.1:{free_port()}"
    result = subprocess.run(
        health_check_command(helm, target, "1"), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert f"the kvtier tier at {target} is not SERVING after 1 s: UNAVAILABLE" in result.stdout


@pytest.fixture
def in_chart_redis(helm: Helm, tmp_path: Path) -> Iterator[tuple[int, str, subprocess.Popen[bytes]]]:
    """The in-chart Redis's container script, run with this machine's redis-server."""
    objects = helm.template(CHART / "ci" / "in-chart-redis-values.yaml")
    container = only_container(objects, "Deployment", "kvtier-redis")
    assert container["command"] == ["sh", "-c"]
    port = free_port()
    (tmp_path / "run").mkdir()
    (tmp_path / "data").mkdir()
    script = (
        container["args"][0]
        .replace("/run/redis", str(tmp_path / "run"))
        .replace("--dir /data", f"--dir {tmp_path / 'data'}")
        .replace("--port 6379", f"--port {port}")
        .replace("'* -::*'", "127.0.0.1")
    )
    password = "s3cret-from-the-secret"
    process = subprocess.Popen(
        ["sh", "-c", script], env={**os.environ, "REDIS_PASSWORD": password}, cwd=tmp_path
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port, password=password).ping()
                break
            except redis.ConnectionError:
                assert process.poll() is None and time.monotonic() < deadline, "redis did not start"
                time.sleep(0.1)
        yield port, password, process
    finally:
        process.terminate()
        process.wait(10)


def test_the_in_chart_redis_requires_the_password_from_the_secret(
    in_chart_redis: tuple[int, str, subprocess.Popen[bytes]],
) -> None:
    port, password, _ = in_chart_redis
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()
    assert redis.Redis(port=port, password=password).ping()


def test_the_in_chart_redis_is_an_lru_cache_without_persistence(
    in_chart_redis: tuple[int, str, subprocess.Popen[bytes]],
) -> None:
    port, password, _ = in_chart_redis
    config = redis.Redis(port=port, password=password, decode_responses=True).config_get("*")
    assert config["maxmemory"] == str(512 * 1024**2)
    assert config["maxmemory-policy"] == "allkeys-lru"
    assert config["save"] == ""
    assert config["appendonly"] == "no"


def test_the_in_chart_redis_password_is_not_on_its_command_line(
    in_chart_redis: tuple[int, str, subprocess.Popen[bytes]],
) -> None:
    _, password, process = in_chart_redis
    command_line = Path(f"/proc/{process.pid}/cmdline").read_bytes()
    assert b"redis-server" in command_line  # exec'd: the shell is gone, redis gets the signals
    assert password.encode() not in command_line


def queried_metrics() -> set[str]:
    """Every tier metric name (kvtier_*, not the connector's kvtier_connector_*, which
    tests/observability checks against a vLLM scrape) in the dashboards' and alerts'
    expressions, with a histogram's _bucket/_sum/_count suffix taken off."""
    exprs = []
    for path in (CHART / "files" / "dashboards").glob("*.json"):
        exprs += [t["expr"] for p in json.loads(path.read_text())["panels"] for t in p.get("targets", [])]
    for path in (CHART / "files" / "rules").glob("*.yaml"):
        exprs += [r["expr"] for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]
    names = {name for expr in exprs for name in re.findall(r"\bkvtier_(?!connector_)[a-z0-9_]+", expr)}
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in names}


def test_every_metric_the_dashboards_and_alerts_query_is_exported_by_the_tier(
    tier: TierProcess,
) -> None:
    # Families are declared (# TYPE) even before their first sample; counters carry _total.
    exported = {
        line.split()[2] for line in tier.metrics().splitlines() if line.startswith("# TYPE kvtier_")
    }
    wanted = queried_metrics()
    assert "kvtier_tier_healthy" in wanted
    assert wanted <= exported, sorted(wanted - exported)
