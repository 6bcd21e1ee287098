"""Real ``kvtier server`` processes for tests.

``TierProcess.start(tmp_dir, *flags)`` runs ``kvtier server`` on free 127.0.0.1
ports with its disk tier under ``tmp_dir`` and returns once its gRPC health
check answers SERVING. It starts the tier as production does: with the data
port on (the operator renders ``--data-port 50052`` unless a CacheTier turns it
off), so a client with ``data_path="auto"`` (the connector's default) moves
values over the data port; ``data_port=False`` is the opt-out for tests whose
subject is the gRPC path. Its ports (gRPC, metrics, data: ``.port``,
``.metrics_port``, ``.data_port``) are picked together, so they differ from each
other; with ``local_socket=True`` it also serves the same-node transport on a
socket in a short-named directory of its own (``.local_socket``; a Unix socket
path has at most 107 bytes, a test's ``tmp_path`` may have more); a port some
other process took before the server bound it costs a retry on new ones, not a
failed start. ``disk_fs_bytes=N`` puts the disk tier on a tmpfs of N
bytes in the server's own user and mount namespace (``unshare``: no privilege
needed), for full-disk tests; the test sees it under ``disk_view``. Fault injection: ``freeze()`` (SIGSTOP), ``thaw()``
(SIGCONT), ``kill()`` (SIGKILL), ``terminate()`` (SIGTERM, graceful), and
``restart()`` (same ports, same disk dir). Always stopped by PID.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.testing.redisprocs import free_ports

START_TIMEOUT_S = 30.0
START_ATTEMPTS = 3
KVTIER = [sys.executable, "-m", "kvtier.cacheserver"]


def health_status(target: str, timeout_s: float = 1.0, service: str = "") -> int | None:
    """The grpc.health.v1 status of ``target`` (None when it does not answer)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status)
        except grpc.RpcError:
            return None


class PortTaken(RuntimeError):
    """The server could not bind one of its ports (another process took it first)."""


def _flag_value(flags: tuple[str, ...] | list[str], name: str) -> str | None:
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return None


@dataclass
class TierProcess:
    directory: Path
    flags: list[str]
    port: int
    metrics_port: int
    data_port: int = 0  # 0: off
    local_socket: str = ""  # "": off
    proc: subprocess.Popen[bytes] | None = None
    disk_fs_bytes: int = 0
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.directory / "server.log"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def disk_view(self) -> Path:
        """The disk tier's directory as the server sees it (through its mount namespace)."""
        assert self.proc is not None
        if not self.disk_fs_bytes:
            return self.directory / "disk"
        return Path(f"/proc/{self.proc.pid}/root") / str(self.directory / "disk").lstrip("/")

    @classmethod
    def start(
        cls,
        directory: Path,
        *flags: str,
        disk_fs_bytes: int = 0,
        data_port: bool = True,
        local_socket: bool = False,
    ) -> TierProcess:
        """Starts a tier, with the data port on a free port unless ``data_port=False`` (or
        ``flags`` name one: ``--data-port 0`` is off too); ``local_socket``: also on a Unix
        socket of its own (unless ``flags`` name one)."""
        directory.mkdir(parents=True, exist_ok=True)
        socket_path = _flag_value(flags, "--local-socket") or ""
        if local_socket and not socket_path:
            socket_path = str(Path(tempfile.mkdtemp(prefix="kvtier-sock-")) / "tier.sock")
            flags = (*flags, "--local-socket", socket_path)
        for attempt in range(START_ATTEMPTS):
            port, metrics_port, free_data_port = free_ports(3)
            given = _flag_value(flags, "--data-port")
            tier = cls(
                directory,
                list(flags),
                port,
                metrics_port,
                data_port=int(given) if given is not None else free_data_port if data_port else 0,
                local_socket=socket_path,
                disk_fs_bytes=disk_fs_bytes,
            )
            try:
                tier._spawn()
            except PortTaken:
                if attempt == START_ATTEMPTS - 1:
                    raise
                continue
            return tier
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        args = [
            *KVTIER,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--metrics-port", str(self.metrics_port),
            "--disk-dir", str(self.directory / "disk"),
            "--ram-bytes", "256MiB",
            "--disk-bytes", "1GiB",
            "--grace-period", "5s",
            *self._data_port_flags(),
            *self.flags,
        ]  # fmt: skip
        if self.disk_fs_bytes:
            (self.directory / "disk").mkdir(exist_ok=True)
            mount = 'mount -t tmpfs -o "size=$1" tmpfs "$2" && shift 2 && exec "$@"'
            args = [
                "unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, "sh",
                str(self.disk_fs_bytes), str(self.directory / "disk"), *args,
            ]  # fmt: skip
        offset = len(self.log.read_text()) if self.log.exists() else 0
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log.read_text()
                taken = any(s in log[offset:] for s in ("cannot listen on", "Address already in use"))
                error = PortTaken if taken else RuntimeError
                raise error(f"kvtier server exited with {self.proc.returncode}:\n{log}")
            if "--tls-cert-file" in self.flags:  # no plaintext health check: wait for the log line
                if "kvtier server listening on" in self.log.read_text()[offset:]:
                    return
            elif health_status(self.target, 0.5) == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"kvtier server did not become SERVING:\n{self.log.read_text()}")

    def _data_port_flags(self) -> list[str]:
        if not self.data_port or _flag_value(self.flags, "--data-port") is not None:
            return []
        return ["--data-port", str(self.data_port)]

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return str(r.read().decode())

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of /metrics (0.0 when absent)."""
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in self.metrics().splitlines():
            if line.startswith("#"):
                continue
            series, _, value = line.rpartition(" ")
            name_part, _, label_part = series.partition("{")
            if name_part != name:
                continue
            got = ",".join(sorted(p for p in label_part.rstrip("}").split(",") if p))
            if got == want:
                return float(value)
        return 0.0

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def terminate(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self._spawn()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.local_socket and Path(self.local_socket).parent.name.startswith("kvtier-sock-"):
            shutil.rmtree(Path(self.local_socket).parent, ignore_errors=True)
