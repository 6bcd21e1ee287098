"""Real ``kvtier server`` processes for tests.

``TierProcess.start(tmp_dir, *flags)`` runs ``kvtier server`` on free 127.0.0.1
ports with its disk tier under ``tmp_dir`` and returns once its gRPC health
check answers SERVING. ``disk_fs_bytes=N`` puts the disk tier on a tmpfs of N
bytes in the server's own user and mount namespace (``unshare``: no privilege
needed), for full-disk tests; the test sees it under ``disk_view``. Fault injection: ``freeze()`` (SIGSTOP), ``thaw()``
(SIGCONT), ``kill()`` (SIGKILL), ``terminate()`` (SIGTERM, graceful), and
``restart()`` (same ports, same disk dir). Always stopped by PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.redisprocs import free_port

START_TIMEOUT_S = 30.0
KVTIER = [sys.executable, "-m", "kvtier.cli", "server"]


def health_status(target: str, timeout_s: float = 1.0, service: str = "") -> int | None:
    """The grpc.health.v1 status of ``target`` (None when it does not answer)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status)
        except grpc.RpcError:
            return None


@dataclass
class TierProcess:
    directory: Path
    flags: list[str]
    port: int
    metrics_port: int
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
    def start(cls, directory: Path, *flags: str, disk_fs_bytes: int = 0) -> TierProcess:
        directory.mkdir(parents=True, exist_ok=True)
        tier = cls(directory, list(flags), free_port(), free_port(), disk_fs_bytes=disk_fs_bytes)
        tier._spawn()
        return tier

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
            *self.flags,
        ]  # fmt: skip
        if self.disk_fs_bytes:
            (self.directory / "disk").mkdir(exist_ok=True)
            mount = 'mount -t tmpfs -o "size=$1" tmpfs "$2" && shift 2 && exec "$@"'
            args = [
                "unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, "sh",
                str(self.disk_fs_bytes), str(self.directory / "disk"), *args,
            ]  # fmt: skip
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.directory)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if "--tls-cert-file" in self.flags:  # no plaintext health check: wait for the log line
                if "kvtier server listening on" in self.log.read_text():
                    return
            elif health_status(self.target, 0.5) == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"kvtier server did not become SERVING:\n{self.log.read_text()}")

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
