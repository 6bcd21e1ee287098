"""The operator's output meets what the programs it runs accept.

The tier: the settings ConfigMap and env the operator writes go through ``kvtier
server``'s own argument parsing (and, once, a real ``kvtier server`` process
started with them). The engines: every kv/ec-transfer config goes through the
connector's own ``ConnectorConfig.from_extra_config``, and an engine's token file
authenticates as its recipe's tenant against a tier with that tier's Secret.

Only paths and ports are rewritten (to tmp dirs and free 127.0.0.1 ports); every
other value is what the operator generated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from kvtier.cacheserver import settings as server_settings
from kvtier.connector.client import TierClient
from kvtier.connector.config import ConnectorConfig
from kvtier.operator.children import (
    AUTH_FILE,
    DATA_PORT,
    DISK_DIR,
    EC_TRANSFER_KEY,
    KV_TRANSFER_KEY,
    METRICS_PORT,
    TENANTS_DIR,
    TIER_PORT,
)
from tests.operator.test_children import (
    AUTH,
    RECIPES,
    TIERS,
    by_kind,
    recipe_children,
    tier_children,
)
from tests.redisprocs import free_port
from tests.tierproc import health_status

TOKENS = {"team-a": "a" * 32, "team-b": "b" * 32}  # the tier's auth Secret
REDIS_PASSWORD = "redis-password-from-the-secret"


def mount_secret(directory: Path, data: dict[str, str]) -> Path:
    """A Secret volume as the kubelet lays it out: ``..data`` -> a timestamped dir, and
    one symlink per key through ``..data``."""
    stamp = directory / "..2026_12_03_00_00_00.000000000"
    stamp.mkdir(parents=True)
    for key, value in data.items():
        (stamp / key).write_text(value)
    (directory / "..data").symlink_to(stamp.name)
    for key in data:
        (directory / key).symlink_to(f"..data/{key}")
    return directory


def tier_env(children: list[dict[str, Any]], tmp_path: Path) -> dict[str, str]:
    """The tier container's environment (ConfigMap + Secret env), paths under tmp_path."""
    (container,) = by_kind(children, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    env = dict(by_kind(children, "ConfigMap")["data"])
    for var in container.get("env", []):
        assert var["valueFrom"]["secretKeyRef"], var  # Secrets only; nothing else is expected
        env[var["name"]] = REDIS_PASSWORD
    if env.get("KVTIER_DISK_DIR") == DISK_DIR:
        env["KVTIER_DISK_DIR"] = str(tmp_path / "disk")
    if env.get("KVTIER_AUTH_TOKENS") == TENANTS_DIR:
        env["KVTIER_AUTH_TOKENS"] = str(mount_secret(tmp_path / "tenants", TOKENS))
    return env


@pytest.mark.parametrize("variant", TIERS)
def test_the_tier_settings_parse_as_kvtier_server_settings_with_the_intended_values(
    variant: str, tmp_path: Path
) -> None:
    spec = TIERS[variant]
    settings = server_settings.parse([], tier_env(tier_children(**spec), tmp_path))
    metrics = spec.get("metrics", {}).get("enabled", True)
    assert (settings.host, settings.port, settings.data_port) == ("0.0.0.0", TIER_PORT, DATA_PORT)
    assert settings.metrics_port == (METRICS_PORT if metrics else 0)  # 0: the server serves none
    disk = spec.get("disk", {}).get("enabled", True)
    if disk:
        assert settings.disk_dir == tmp_path / "disk" and settings.disk_bytes > 0
    else:
        assert settings.disk_bytes == 0  # no disk tier, not the server's ~/.cache default
    if "redis" in spec:
        url = spec["redis"]["url"]
        scheme = url.split("://")[0] + ("+cluster" if spec["redis"].get("cluster") else "")
        assert settings.redis_url == f"{scheme}://{url.split('://')[1]}"
        assert settings.redis_password == REDIS_PASSWORD
    else:
        assert settings.redis_url is None
    if "authSecretRef" in spec:
        assert settings.auth_tokens == tmp_path / "tenants"
    else:
        assert settings.auth_tokens is None


def test_the_tier_reads_every_tenant_of_its_mounted_auth_secret(tmp_path: Path) -> None:
    from kvtier.cacheserver.auth import load_tokens

    env = tier_env(tier_children(authSecretRef={"name": AUTH}), tmp_path)
    settings = server_settings.parse([], env)
    assert settings.auth_tokens is not None
    entries = load_tokens(settings.auth_tokens)
    assert {(e.tenant, e.token.decode()) for e in entries} == set(TOKENS.items())


def connector_configs(recipe: dict[str, Any], tier_auth: str | None) -> list[dict[str, Any]]:
    data = by_kind(recipe_children(tier_auth, **recipe), "ConfigMap")["data"]
    configs = [json.loads(data[KV_TRANSFER_KEY])["kv_connector_extra_config"]]
    if EC_TRANSFER_KEY in data:
        configs.append(json.loads(data[EC_TRANSFER_KEY])["ec_connector_extra_config"])
    return configs


@pytest.mark.parametrize("tier_auth", [None, AUTH], ids=["no auth", "auth"])
@pytest.mark.parametrize("variant", RECIPES)
def test_every_connector_config_the_operator_writes_parses_as_the_connectors_config(
    variant: str, tier_auth: str | None, tmp_path: Path
) -> None:
    spec = RECIPES[variant]
    cache = spec.get("cache", {})
    token_file = tmp_path / "token"
    token_file.write_text(TOKENS["team-a"] + "\n")
    for extra in connector_configs(spec, tier_auth):
        if tier_auth is not None:
            assert extra["auth_token_file"] == AUTH_FILE
            extra["auth_token_file"] = str(token_file)
        config = ConnectorConfig.from_extra_config(extra)
        assert config.codec == cache.get("codec", "raw")
        assert config.chunk_size == cache.get("chunkSize", 256)
        policy = cache.get("saltPolicy", "request")
        assert config.salt_policy == ("request" if policy == "namespace" else policy)
        assert config.salt == ("ml" if policy == "namespace" else None)
        assert config.token == (TOKENS["team-a"] if tier_auth is not None else None)


def test_an_engine_authenticates_as_its_tenant_and_uses_the_data_port_of_a_tier_the_operator_configured(
    tmp_path: Path,
) -> None:
    env = tier_env(tier_children(authSecretRef={"name": AUTH}), tmp_path)
    port, data_port = free_port(), free_port()
    env |= {
        "KVTIER_HOST": "127.0.0.1", "KVTIER_PORT": str(port), "KVTIER_DATA_PORT": str(data_port),
        "KVTIER_METRICS_PORT": str(free_port()), "KVTIER_RAM_BYTES": "64MiB",
        "KVTIER_DISK_BYTES": "64MiB",
    }  # fmt: skip
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "server"],
            env={**os.environ, "PYTHONSAFEPATH": "1", **env}, cwd=tmp_path,
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while health_status(f"127.0.0.1:{port}", 0.5) != health_pb2.HealthCheckResponse.SERVING:
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        clients = {}
        for tenant in TOKENS:
            # The engine's token volume: the Secret's key spec.cache.tenant, as file "token".
            (extra,) = connector_configs({"cache": {"tenant": tenant}}, AUTH)
            token_dir = mount_secret(tmp_path / f"engine-{tenant}", {"token": TOKENS[tenant]})
            extra |= {"target": f"127.0.0.1:{port}", "auth_token_file": str(token_dir / "token")}
            config = ConnectorConfig.from_extra_config(extra)
            clients[tenant] = TierClient(config.target, token=config.token, data_path="data")
        try:
            assert clients["team-a"].stats().data_port == data_port
            assert clients["team-a"].put([(b"chunk", b"kv bytes")]) == 1
            assert clients["team-a"].get([b"chunk"]) == [b"kv bytes"]
            assert clients["team-b"].lookup([b"chunk"]) == 0  # another tenant: a miss
        finally:
            for client in clients.values():
                client.close()
    finally:
        server.terminate()
        server.wait(30)
