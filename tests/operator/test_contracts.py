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

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from kvtier.cacheserver import settings as server_settings
from kvtier.connector.client import TierClient
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.errors import TierError
from kvtier.operator.children import (
    AUTH_FILE,
    CLIENT_TLS_DIR,
    DATA_PORT,
    DISK_DIR,
    EC_TRANSFER_KEY,
    KV_TRANSFER_KEY,
    METRICS_PORT,
    TENANTS_DIR,
    TIER_PORT,
    TLS_DIR,
)
from kvtier.operator.spec import parse_tier_spec
from tests.operator.test_children import (
    AUTH,
    RECIPES,
    TIERS,
    TLS,
    by_kind,
    recipe_children,
    tier_children,
)
from tests.redisprocs import TlsFiles, free_port
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


def tls_secrets(tmp_path: Path) -> dict[str, dict[str, str]]:
    """The tier's kubernetes.io/tls Secret and an engine's, as cert-manager writes them."""
    files = TlsFiles.generate(tmp_path / "pki")
    ca = files.ca.read_text()
    return {
        "tier": {"tls.crt": files.server_cert.read_text(), "tls.key": files.server_key.read_text(),
                 "ca.crt": ca},
        "engine": {"tls.crt": files.client_cert.read_text(), "tls.key": files.client_key.read_text(),
                   "ca.crt": ca},
    }  # fmt: skip


def mount_items(directory: Path, secret: dict[str, str], volume: dict[str, Any]) -> Path:
    """A Secret volume with ``items``: only the listed keys, as the listed paths."""
    data = {item["path"]: secret[item["key"]] for item in volume["secret"]["items"]}
    return mount_secret(directory, data)


def tier_env(
    children: list[dict[str, Any]], tmp_path: Path, tls: dict[str, str] | None = None
) -> dict[str, str]:
    """The tier container's environment (ConfigMap + Secret env), paths under tmp_path; ``tls``:
    the data of the tier's TLS Secret."""
    (container,) = by_kind(children, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    env = dict(by_kind(children, "ConfigMap")["data"])
    for var in container.get("env", []):
        assert var["valueFrom"]["secretKeyRef"], var  # Secrets only; nothing else is expected
        env[var["name"]] = REDIS_PASSWORD
    if env.get("KVTIER_DISK_DIR") == DISK_DIR:
        env["KVTIER_DISK_DIR"] = str(tmp_path / "disk")
    if env.get("KVTIER_AUTH_TOKENS") == TENANTS_DIR:
        env["KVTIER_AUTH_TOKENS"] = str(mount_secret(tmp_path / "tenants", TOKENS))
    pod = by_kind(children, "StatefulSet")["spec"]["template"]["spec"]
    tls_volume = next((v for v in pod["volumes"] if v["name"] == "tls"), None)
    if tls_volume is not None:
        assert tls is not None, "the tier mounts a TLS Secret: give its data"
        directory = mount_items(tmp_path / "tier-tls", tls, tls_volume)
        for name in ("KVTIER_TLS_CERT_FILE", "KVTIER_TLS_KEY_FILE", "KVTIER_TLS_CLIENT_CA_FILE"):
            if name in env:
                env[name] = env[name].replace(TLS_DIR, str(directory))
    return env


@pytest.mark.parametrize("variant", TIERS)
def test_the_tier_settings_parse_as_kvtier_server_settings_with_the_intended_values(
    variant: str, tmp_path: Path
) -> None:
    spec = TIERS[variant]
    tls = tls_secrets(tmp_path)["tier"] if "tls" in spec else None
    settings = server_settings.parse([], tier_env(tier_children(**spec), tmp_path, tls))
    metrics = spec.get("metrics", {}).get("enabled", True)
    data_port = DATA_PORT if parse_tier_spec(spec, "spec").data_port else 0  # 0: the server's off
    assert (settings.host, settings.port, settings.data_port) == ("0.0.0.0", TIER_PORT, data_port)
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
    if "tls" in spec:
        assert settings.tls_cert_file == tmp_path / "tier-tls" / "tls.crt"
        assert settings.tls_key_file == tmp_path / "tier-tls" / "tls.key"
        client_auth = spec["tls"].get("clientAuth", False)
        assert settings.tls_client_ca_file == (
            tmp_path / "tier-tls" / "ca.crt" if client_auth else None
        )
    else:
        assert settings.tls_cert_file is None


def test_the_tier_reads_every_tenant_of_its_mounted_auth_secret(tmp_path: Path) -> None:
    from kvtier.cacheserver.auth import load_tokens

    env = tier_env(tier_children(authSecretRef={"name": AUTH}), tmp_path)
    settings = server_settings.parse([], env)
    assert settings.auth_tokens is not None
    entries = load_tokens(settings.auth_tokens)
    assert {(e.tenant, e.token.decode()) for e in entries} == set(TOKENS.items())


@contextlib.contextmanager
def run_tier(
    env: dict[str, str], tmp_path: Path, *, tls: bool = False
) -> Iterator[tuple[int, int]]:
    """A ``kvtier server`` process with ``env`` on free 127.0.0.1 ports and small tiers,
    once it serves (plaintext: its health check answers SERVING; TLS: its port accepts
    connections); its (gRPC, data) ports."""
    port, data_port = free_port(), free_port()
    env = env | {
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
    target = ("127.0.0.1", port)
    try:
        deadline = time.monotonic() + 30
        while not (_accepts(target) if tls else health_status(f"{target[0]}:{target[1]}", 0.5)
                   == health_pb2.HealthCheckResponse.SERVING):  # fmt: skip
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield port, data_port
    finally:
        server.terminate()
        server.wait(30)


def _accepts(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=0.5).close()
    except OSError:
        return False
    return True


def connector_configs(
    recipe: dict[str, Any], tier_auth: str | None, tier_spec: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    data = by_kind(recipe_children(tier_auth, tier_spec, **recipe), "ConfigMap")["data"]
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
    with run_tier(env, tmp_path) as (port, data_port):
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


@pytest.mark.parametrize("variant", RECIPES)
def test_every_tls_connector_config_the_operator_writes_parses_with_the_files_it_mounts(
    variant: str, tmp_path: Path
) -> None:
    spec = RECIPES[variant]
    secrets = tls_secrets(tmp_path)
    children = recipe_children(None, TLS, **spec)
    pod = by_kind(children, "Deployment")["spec"]["template"]["spec"]
    mounts = {
        volume["name"]: mount_items(tmp_path / volume["name"], secrets[owner], volume)
        for volume in pod["volumes"]
        for name, owner in (("kvtier-tls", "tier"), ("kvtier-client-tls", "engine"))
        if volume["name"] == name
    }
    for extra in connector_configs(spec, None, TLS):
        assert extra["tls_ca_file"] == f"{TLS_DIR}/ca.crt"
        extra["tls_ca_file"] = str(mounts["kvtier-tls"] / "ca.crt")
        if "clientCertSecretRef" in spec.get("cache", {}):
            for key in ("tls_cert_file", "tls_key_file"):
                assert extra[key].startswith(CLIENT_TLS_DIR)
                extra[key] = extra[key].replace(CLIENT_TLS_DIR, str(mounts["kvtier-client-tls"]))
        else:
            assert "tls_cert_file" not in extra
        config = ConnectorConfig.from_extra_config(extra)
        assert config.tls_ca_file is not None


def test_an_engine_reaches_a_mutual_tls_tier_the_operator_configured_over_grpc_and_the_data_port(
    tmp_path: Path,
) -> None:
    secrets = tls_secrets(tmp_path)
    env = tier_env(tier_children(authSecretRef={"name": AUTH}, **TLS), tmp_path, secrets["tier"])
    recipe = {"cache": {"tenant": "team-a", "clientCertSecretRef": {"name": "engine-tls"}}}
    pod = by_kind(recipe_children(AUTH, TLS, **recipe), "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    ca_dir = mount_items(tmp_path / "engine-ca", secrets["tier"], volumes["kvtier-tls"])
    cert_dir = mount_items(
        tmp_path / "engine-cert", secrets["engine"], volumes["kvtier-client-tls"]
    )
    token_dir = mount_secret(tmp_path / "engine-token", {"token": TOKENS["team-a"]})
    (extra,) = connector_configs(recipe, AUTH, TLS)
    extra |= {
        "auth_token_file": str(token_dir / "token"),
        "tls_ca_file": extra["tls_ca_file"].replace(TLS_DIR, str(ca_dir)),
        "tls_cert_file": extra["tls_cert_file"].replace(CLIENT_TLS_DIR, str(cert_dir)),
        "tls_key_file": extra["tls_key_file"].replace(CLIENT_TLS_DIR, str(cert_dir)),
    }
    with run_tier(env, tmp_path, tls=True) as (port, _):
        config = ConnectorConfig.from_extra_config(extra | {"target": f"127.0.0.1:{port}"})
        tls = {"tls_ca_file": config.tls_ca_file, "tls_cert_file": config.tls_cert_file,
               "tls_key_file": config.tls_key_file}  # fmt: skip
        for data_path in ("data", "grpc"):
            with TierClient(config.target, token=config.token, data_path=data_path, **tls) as c:
                assert c.put([(data_path.encode(), b"kv bytes")]) == 1
                assert c.get([data_path.encode()]) == [b"kv bytes"]
        # Without the client certificate the tier does not let the engine in.
        no_cert = {"tls_ca_file": config.tls_ca_file}
        with (
            TierClient(config.target, token=config.token, timeout_s=3, **no_cert) as c,
            pytest.raises(TierError),
        ):
            c.lookup([b"data"])
