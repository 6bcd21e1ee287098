"""Settings of ``kvtier server``: read once from flags and ``KVTIER_*`` env vars, validated.

Every flag ``--some-flag`` can also be given as the env var ``KVTIER_SOME_FLAG``;
a flag on the command line wins over the env var. Sizes accept ``B``, ``KiB``,
``MiB``, ``GiB``, ``TiB`` (and ``KB``/``MB``/``GB``/``TB`` as powers of 1000);
durations accept ``ms``, ``s``, ``m`` or a plain number of seconds. A bad value
stops the server at start-up with a message naming the flag, its env var and
what it accepts.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.cacheserver.errors import SettingsError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "h": 3600.0}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError("a size such as 512MiB, 2GiB or 1000000 (bytes)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _DURATION_UNITS:
        raise ValueError("a duration such as 500ms, 2s, 5m, 24h or 1.5 (seconds)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def format_size(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def default_disk_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier" / "tier"


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 50051
    data_port: int = 0
    data_timeout_s: float = 30.0
    data_max_connections: int = 1024
    metrics_port: int = 9400
    ram_bytes: int = 2 << 30
    ram_recycle_bytes: int = 256 << 20
    disk_dir: Path | None = None
    disk_bytes: int = 20 << 30
    disk_fsync: bool = False
    redis_url: str | None = None
    redis_password: str | None = None
    redis_tls_ca_file: Path | None = None
    redis_tls_cert_file: Path | None = None
    redis_tls_key_file: Path | None = None
    redis_timeout_s: float = 0.5
    redis_ttl_s: float = 0.0
    write_policy: str = "write-behind"
    write_behind_bytes: int = 256 << 20
    tier_timeout_s: float = 1.0
    max_value_bytes: int = 256 << 20
    incoming_bytes: int = 256 << 20
    frame_bytes: int = 4 << 20
    max_keys: int = 4096
    max_key_bytes: int = 256
    grace_period_s: float = 10.0
    log_level: str = "info"
    auth_tokens: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    tenant_quota_bytes: int = 0
    local_socket: Path | None = None

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class _Flag:
    name: str  # flag without dashes, e.g. "ram-bytes"
    field: str
    parse: Callable[[str], Any]
    help: str
    accepts: str

    @property
    def env(self) -> str:
        return "KVTIER_" + self.name.upper().replace("-", "_")


def _port(text: str) -> int:
    n = int(text)
    if not 0 <= n <= 65535:
        raise ValueError
    return n


def _positive_int(text: str) -> int:
    n = int(text)
    if n <= 0:
        raise ValueError
    return n


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ValueError


def _choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in values:
            raise ValueError
        return text

    return parse


_FLAGS = [
    _Flag("host", "host", str, "address to listen on (0.0.0.0 in a pod)", "an IP address or host name"),
    _Flag("port", "port", _port, "gRPC port (0: pick a free one)", "a port number 0..65535"),
    _Flag("data-port", "data_port", _port,
          "raw-bytes data port for Get/Put values (same auth and TLS as gRPC; advertised in Stats); "
          "0: off (50052 is the recommended port)", "a port number 0..65535"),
    _Flag("data-timeout", "data_timeout_s", parse_duration,
          "a data-port connection that sends nothing for this long (idle, or stalled inside a request), "
          "or a gRPC Put stream that sends no frame for this long, is closed",
          "a duration such as 30s"),
    _Flag("data-max-connections", "data_max_connections", _positive_int,
          "most data-port connections open at once; one more is closed at once (kvtier's client "
          "then moves values over gRPC for a minute)", "a positive integer"),
    _Flag("metrics-port", "metrics_port", _port, "Prometheus /metrics HTTP port (0: off)", "a port number 0..65535"),
    _Flag("ram-bytes", "ram_bytes", parse_size, "RAM tier capacity", "a size such as 2GiB"),
    _Flag("ram-recycle-bytes", "ram_recycle_bytes", parse_size,
          "most bytes of dropped values' buffers (1MiB and larger) the RAM tier keeps to receive new values "
          "into, counted within --ram-bytes and at most a quarter of it (0: off)", "a size such as 256MiB, or 0"),
    _Flag("disk-dir", "disk_dir", Path, "disk tier directory (default ~/.cache/kvtier/tier)", "a directory path"),
    _Flag("disk-bytes", "disk_bytes", parse_size, "disk tier capacity (0: no disk tier)", "a size such as 20GiB, or 0"),
    _Flag("disk-fsync", "disk_fsync", _bool, "fsync each disk write (survives power loss; slower)", "true or false"),
    _Flag("redis-url", "redis_url", str, "Redis tier: redis://, rediss:// (TLS), unix:// or redis+cluster:// URL", "a Redis URL"),
    _Flag("redis-password", "redis_password", str, "Redis password (prefer the env var)", "a string"),
    _Flag("redis-tls-ca-file", "redis_tls_ca_file", Path, "CA bundle that signed the Redis server's certificate (rediss://)", "a file path"),
    _Flag("redis-tls-cert-file", "redis_tls_cert_file", Path, "client certificate for Redis mutual TLS", "a file path"),
    _Flag("redis-tls-key-file", "redis_tls_key_file", Path, "client key for Redis mutual TLS", "a file path"),
    _Flag("redis-timeout", "redis_timeout_s", parse_duration, "deadline of each Redis call", "a duration such as 500ms"),
    _Flag("redis-ttl", "redis_ttl_s", parse_duration, "expiry of values written to Redis (0: none)", "a duration such as 24h, or 0"),
    _Flag("write-policy", "write_policy", _choice("write-behind", "write-through"),
          "write-behind: Put returns once RAM holds the value; write-through: once every tier does",
          "write-behind or write-through"),
    _Flag("write-behind-bytes", "write_behind_bytes", parse_size,
          "most bytes waiting to be written behind to each lower tier (more: the copy is dropped and counted)",
          "a size such as 256MiB"),
    _Flag("tier-timeout", "tier_timeout_s", parse_duration, "deadline of a disk/Redis operation before the tier is marked failing", "a duration such as 1s"),
    _Flag("max-value-bytes", "max_value_bytes", parse_size, "largest value (chunk) accepted", "a size such as 256MiB"),
    _Flag("incoming-bytes", "incoming_bytes", parse_size,
          "most bytes of values being received at once, over every Put on both ports (each value holds "
          "its whole length from its first byte to its last); a Put beyond it is refused with UNAVAILABLE "
          "(retry); at least --max-value-bytes", "a size such as 256MiB"),
    _Flag("frame-bytes", "frame_bytes", parse_size, "size of the frames Get sends", "a size from 64KiB to 16MiB"),
    _Flag("max-keys", "max_keys", _positive_int, "most keys in one Lookup/Get/Delete", "a positive integer"),
    _Flag("max-key-bytes", "max_key_bytes", _positive_int, "longest key accepted", "a positive integer up to 1024"),
    _Flag("grace-period", "grace_period_s", parse_duration, "on SIGTERM, how long in-flight calls may finish", "a duration such as 10s"),
    _Flag("auth-tokens", "auth_tokens", Path,
          "bearer tokens: a directory with one file per tenant (a mounted Secret) or a file of 'tenant token' lines; "
          "without it every caller is tenant 'default'", "a file or directory path"),
    _Flag("tls-cert-file", "tls_cert_file", Path, "serve gRPC over TLS with this certificate (PEM)", "a file path"),
    _Flag("tls-key-file", "tls_key_file", Path, "private key of --tls-cert-file (PEM)", "a file path"),
    _Flag("tls-client-ca-file", "tls_client_ca_file", Path,
          "require client certificates signed by this CA (mutual TLS)", "a file path"),
    _Flag("tenant-quota-bytes", "tenant_quota_bytes", parse_size,
          "most bytes one tenant may hold in each tier (RAM, disk and Redis); a tenant at its quota "
          "evicts its own least recently used entries (0: no quota)", "a size such as 1GiB, or 0"),
    _Flag("local-socket", "local_socket", Path,
          "also serve the same-node transport on this Unix socket (values through shared memory; "
          "the RAM tier then keeps values in memfd segments it shares read-only); a stale socket file "
          "there is replaced, the socket is made group-writable (0660)", "a file path of at most 107 bytes"),
    _Flag("log-level", "log_level", _choice("debug", "info", "warning", "error"), "log level", "debug, info, warning or error"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings()
    for flag in _FLAGS:
        default = getattr(defaults, flag.field)
        shown = "off" if default is None and flag.field != "disk_dir" else default
        if flag.field == "disk_dir":
            shown = default_disk_dir()
        elif flag.parse is parse_size:
            shown = format_size(default)
        elif flag.parse is parse_duration:
            shown = f"{default:g}s"
        parser.add_argument(
            f"--{flag.name}",
            dest=flag.field,
            metavar=flag.name.split("-")[-1].upper(),
            default=None,
            help=f"{flag.help} [env {flag.env}; default {shown}]",
        )


def from_args(args: argparse.Namespace, env: dict[str, str] | None = None) -> Settings:
    """Builds validated Settings from parsed flags, falling back to KVTIER_* env vars."""
    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {}
    for flag in _FLAGS:
        raw = getattr(args, flag.field, None)
        source = f"--{flag.name}"
        if raw is None and flag.env in env:
            raw, source = env[flag.env], flag.env
        if raw is None:
            continue
        try:
            values[flag.field] = flag.parse(raw)
        except (ValueError, TypeError):
            raise SettingsError(
                f"{source}={raw!r} is invalid: expected {flag.accepts} "
                f"(flag --{flag.name}, env {flag.env})"
            ) from None
    settings = Settings(**values)
    if settings.disk_dir is None and settings.disk_bytes > 0:
        settings = Settings(**{**values, "disk_dir": default_disk_dir()})
    _check(settings)
    return settings


def parse(argv: Sequence[str], env: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="kvtier server")
    add_arguments(parser)
    return from_args(parser.parse_args(list(argv)), env)


def _check(s: Settings) -> None:
    def bad(flag: str, message: str) -> SettingsError:
        env = "KVTIER_" + flag.upper().replace("-", "_")
        return SettingsError(f"--{flag} (env {env}): {message}")

    if s.ram_bytes <= 0:
        raise bad("ram-bytes", "must be greater than 0 (the RAM tier is always on)")
    if s.frame_bytes < 64 << 10 or s.frame_bytes > 16 << 20:
        raise bad("frame-bytes", "must be between 64KiB and 16MiB")
    if s.max_value_bytes <= 0:
        raise bad("max-value-bytes", "must be greater than 0")
    if s.incoming_bytes < s.max_value_bytes:
        raise bad(
            "incoming-bytes",
            f"{format_size(s.incoming_bytes)} is less than --max-value-bytes "
            f"({format_size(s.max_value_bytes)}): a value that large could never be received; "
            "raise --incoming-bytes or lower --max-value-bytes",
        )
    if s.max_key_bytes > 1024:
        raise bad("max-key-bytes", "must be at most 1024")
    if s.redis_url is not None and not re.match(r"^(redis|rediss|unix|redis\+cluster|rediss\+cluster)://", s.redis_url):
        raise bad("redis-url", "must start with redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://")
    if s.data_port and s.data_port in (s.port, s.metrics_port):
        raise bad("data-port", f"{s.data_port} is already the gRPC or metrics port; give it a port of its own")
    for flag, value in (
        ("redis-timeout", s.redis_timeout_s),
        ("tier-timeout", s.tier_timeout_s),
        ("data-timeout", s.data_timeout_s),
    ):
        if value <= 0:
            raise bad(flag, "must be greater than 0")
    for flag, path in (
        ("redis-tls-ca-file", s.redis_tls_ca_file),
        ("redis-tls-cert-file", s.redis_tls_cert_file),
        ("redis-tls-key-file", s.redis_tls_key_file),
    ):
        if path is not None and not path.is_file():
            raise bad(flag, f"{path} is not a readable file")
    for flag, path in (
        ("tls-cert-file", s.tls_cert_file),
        ("tls-key-file", s.tls_key_file),
        ("tls-client-ca-file", s.tls_client_ca_file),
    ):
        if path is not None and not path.is_file():
            raise bad(flag, f"{path} is not a readable file")
    if (s.tls_cert_file is None) != (s.tls_key_file is None):
        raise bad("tls-cert-file", "give both --tls-cert-file and --tls-key-file, or neither")
    if s.tls_client_ca_file is not None and s.tls_cert_file is None:
        raise bad("tls-client-ca-file", "mutual TLS needs --tls-cert-file and --tls-key-file too")
    if s.auth_tokens is not None and not s.auth_tokens.exists():
        raise bad("auth-tokens", f"{s.auth_tokens} does not exist")
    if (s.redis_tls_cert_file is None) != (s.redis_tls_key_file is None):
        raise bad("redis-tls-cert-file", "give both --redis-tls-cert-file and --redis-tls-key-file, or neither")
    if s.redis_ttl_s < 0 or 0 < s.redis_ttl_s < 1 or s.redis_ttl_s != int(s.redis_ttl_s):
        raise bad("redis-ttl", "must be 0 (no expiry) or a whole number of seconds such as 3600 or 24h")
    if s.write_behind_bytes <= 0:
        raise bad("write-behind-bytes", "must be greater than 0 (it bounds the copies waiting for each lower tier)")
    if s.grace_period_s < 0:
        raise bad("grace-period", "must be 0 or positive")
    if s.local_socket is not None and len(os.fsencode(s.local_socket)) > 107:
        raise bad("local-socket", f"{s.local_socket} is longer than a Unix socket path may be (107 bytes)")
