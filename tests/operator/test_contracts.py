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
    TENANT_QUOTA_SETTINGS,
    TENANTS_DIR,
    TIER_PORT,
    TLS_DIR,
)
from kvtier.operator.quantity import parse_bytes
from kvtier.operator.spec import parse_tier_spec
from kvtier.testing.redisprocs import TlsFiles, free_port
from kvtier.testing.tierproc import health_status
from tests.operator.test_children import (
    AUTH,
    RECIPES,
    TIERS,
    TLS,
    by_kind,
    recipe_children,
    tier_children,
)

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
    pod = next(c for c in children if c["kind"] in ("StatefulSet", "DaemonSet"))["spec"][
        "template"
    ]["spec"]
    (container,) = pod["containers"]
    env = dict(by_kind(children, "ConfigMap")["data"])
    for var in container.get("env", []):
        assert var["valueFrom"]["secretKeyRef"], var  # Secrets only; nothing else is expected
        env[var["name"]] = REDIS_PASSWORD
    if env.get("KVTIER_DISK_DIR") == DISK_DIR:
        env["KVTIER_DISK_DIR"] = str(tmp_path / "disk")
    if env.get("KVTIER_AUTH_TOKENS") == TENANTS_DIR:
        env["KVTIER_AUTH_TOKENS"] = str(mount_secret(tmp_path / "tenants", TOKENS))
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
    assert settings.tenant_quota_bytes == (
        parse_bytes(spec["tenantQuotaBytes"]) if "tenantQuotaBytes" in spec else 0
    )
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
    env: dict[str, str], tmp_path: Path, *, tls: bool = False, disk: bool = True
) -> Iterator[tuple[int, int]]:
    """A ``kvtier server`` process with ``env`` on free 127.0.0.1 ports and small tiers,
    once it serves (plaintext: its health check answers SERVING; TLS: its port accepts
    connections); its (gRPC, data) ports."""
    port, data_port = free_port(), free_port()
    env = env | {
        "KVTIER_HOST": "127.0.0.1", "KVTIER_PORT": str(port), "KVTIER_DATA_PORT": str(data_port),
        "KVTIER_METRICS_PORT": str(free_port()), "KVTIER_RAM_BYTES": "64MiB",
        "KVTIER_DISK_BYTES": "64MiB" if disk else "0",
    }  # fmt: skip
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cacheserver"],
            env={**os.environ, **env}, cwd=tmp_path,
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


# What vLLM's API server makes of the engine container's command line: its own parser, and
# the model config it builds from it (the step that reads config.json from --model).
VLLM_READS_ARGS = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
model = AsyncEngineArgs.from_cli_args(args).create_model_config()
print(json.dumps({
    "model": model.model, "revision": model.revision, "served": model.served_model_name,
    "architectures": model.architectures,
    "extra": args.kv_transfer_config.kv_connector_extra_config,
}))
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_loads_a_volume_model_from_the_mounted_path_and_serves_it_under_the_recipes_name(
    tmp_path: Path,
) -> None:
    from kvtier.operator.weights import MODEL_DIR
    from kvtier.testing.tinymodels import build_text_model

    volume = tmp_path / "volume"  # the claim's content, mounted at MODEL_DIR in the pod
    build_text_model(volume / "qwen" / "qwen2-tiny")
    model = {"repo": "Qwen/Qwen2-0.5B", "architecture": "Qwen2ForCausalLM",
             "volume": {"claimName": "weights", "path": "qwen/qwen2-tiny"}}  # fmt: skip
    children = recipe_children(model=model, engine={"image": "vllm:cpu", "gpus": 0})
    (container,) = by_kind(children, "Deployment")["spec"]["template"]["spec"]["containers"]
    config = by_kind(children, "ConfigMap")["data"]
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    expanded: dict[str, str] = {}  # $(VAR) in args, as the kubelet expands them
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = expanded[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["configMapKeyRef"]
            expanded[var["name"]] = config[ref["key"]]
    assert env["HF_HUB_OFFLINE"] == "1"
    args = [expanded.get(arg[2:-1], arg) if arg.startswith("$(") else arg for arg in container["args"]]
    args = [arg.replace(MODEL_DIR, str(volume), 1) if arg.startswith(MODEL_DIR) else arg for arg in args]
    done = subprocess.run(
        [sys.executable, "-c", VLLM_READS_ARGS, *args],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["model"] == str(volume / "qwen" / "qwen2-tiny")
    assert seen["served"] == "Qwen/Qwen2-0.5B"  # what clients ask for
    assert seen["revision"] == "main"  # pinned in every key
    assert seen["architectures"] == ["Qwen2ForCausalLM"]
    assert seen["extra"]["model_id"] == "Qwen/Qwen2-0.5B"
    assert ConnectorConfig.from_extra_config(seen["extra"]).model_id == "Qwen/Qwen2-0.5B"


def test_every_quota_setting_of_a_cache_tier_is_a_per_tenant_quota_flag_of_the_server() -> None:
    # The map from spec.tenantQuotaBytes to the server's flags lives in one place
    # (children.TENANT_QUOTA_SETTINGS): each must be a flag the server knows, and parse to
    # the quota in bytes.
    known = {flag.env: flag for flag in server_settings._FLAGS}
    for name in TENANT_QUOTA_SETTINGS:
        assert name in known, f"{name} is not a kvtier server setting"
        assert "quota" in known[name].name and "tenant" in known[name].name
        assert getattr(server_settings.parse([], {name: str(3 << 20)}), known[name].field) == 3 << 20


def test_a_tenant_at_the_quota_the_operator_set_evicts_its_own_entries_never_anothers(
    tmp_path: Path,
) -> None:
    quota = 256 << 10
    env = tier_env(
        tier_children(authSecretRef={"name": AUTH}, tenantQuotaBytes=quota, disk={"enabled": False}),
        tmp_path,
    )
    assert env["KVTIER_TENANT_QUOTA_BYTES"] == str(quota)
    with run_tier(env, tmp_path, disk=False) as (port, _):
        clients = {
            tenant: TierClient(f"127.0.0.1:{port}", token=token, data_path="grpc")
            for tenant, token in TOKENS.items()
        }
        try:
            value = b"x" * (64 << 10)
            b_keys = [b"b-0", b"b-1"]
            assert clients["team-b"].put([(key, value) for key in b_keys]) == 2
            a_keys = [f"a-{i}".encode() for i in range(12)]  # 768 KiB: three times the quota
            for key in a_keys:
                assert clients["team-a"].put([(key, value)]) == 1
            kept = [key for key in a_keys if clients["team-a"].get([key]) != [None]]
            assert a_keys[-1] in kept and len(kept) <= quota // len(value)
            assert clients["team-b"].get(b_keys) == [value, value]  # never team-a's to evict
        finally:
            for client in clients.values():
                client.close()


# The same-node transport (issue 18): the names a per-node tier and its engines are given are
# the ones the server and the connector read.
def test_a_per_node_tier_listens_on_the_local_socket_the_operator_sets(tmp_path: Path) -> None:
    from kvtier.operator.topology import LOCAL_SOCKET

    settings = server_settings.parse([], tier_env(tier_children(**TIERS["per node"]), tmp_path))
    assert settings.local_socket == Path(LOCAL_SOCKET)


def test_engines_of_a_per_node_tier_get_a_local_socket_the_connector_reads() -> None:
    from kvtier.operator.topology import LOCAL_SOCKET

    (extra,) = connector_configs({}, None, TIERS["per node"])
    assert extra["local_socket"] == LOCAL_SOCKET
    config = ConnectorConfig.from_extra_config(extra)
    assert config.local_socket == LOCAL_SOCKET
