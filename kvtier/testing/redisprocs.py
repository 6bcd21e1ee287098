"""Real ``redis-server`` processes for tests: standalone (TCP, unix socket, TLS) and Cluster.

Every server runs from its own directory with its own config, listens only on
127.0.0.1 and on a unix socket, and is stopped by its PID; the machine's default
Redis is never touched. Fixtures in ``tests/cacheserver/conftest.py`` wrap these;
other test packages can import this module and do the same::

    server = RedisServer.start(tmp_path / "redis")
    try:
        ... server.url ...
    finally:
        server.stop()

Fault injection: ``pause()`` (SIGSTOP), ``resume()`` (SIGCONT), ``kill()``
(SIGKILL) and ``restart()`` (same ports, same config, empty data).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from redis.crc import key_slot

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"
START_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` different TCP ports on 127.0.0.1 that nothing listens on right now.

    Bound all at once, so they differ from each other (ports picked one at a time
    may repeat: the kernel can hand out a port again as soon as it is closed).
    """
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA and a server and client certificate it signed (for 127.0.0.1/localhost)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def generate(cls, directory: Path) -> TlsFiles:
        directory.mkdir(parents=True, exist_ok=True)
        d = directory

        def openssl(*args: str | Path) -> None:
            subprocess.run([OPENSSL, *map(str, args)], check=True, capture_output=True)

        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
        openssl("req", "-x509", *ec, "-keyout", d / "ca.key", "-out", d / "ca.crt",
                "-days", "2", "-subj", "/CN=kvtier test CA")  # fmt: skip
        (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
        for name in ("server", "client"):
            openssl("req", "-new", *ec, "-keyout", d / f"{name}.key", "-out", d / f"{name}.csr",
                    "-subj", f"/CN=kvtier test {name}")  # fmt: skip
            openssl("x509", "-req", "-in", d / f"{name}.csr", "-CA", d / "ca.crt",
                    "-CAkey", d / "ca.key", "-CAcreateserial", "-days", "2",
                    "-extfile", d / f"{name}.ext", "-out", d / f"{name}.crt")  # fmt: skip
        return cls(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt",
                   d / "client.key")  # fmt: skip


@dataclass
class RedisServer:
    """One ``redis-server`` process (see the module docstring)."""

    directory: Path
    port: int  # 0: no plain TCP listener
    unix_socket: Path
    tls_port: int = 0
    password: str | None = None
    config: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(
        cls,
        directory: Path,
        *,
        tcp: bool = True,
        tls: TlsFiles | None = None,
        password: str | None = None,
        cluster: bool = False,
        config: dict[str, str] | None = None,
    ) -> RedisServer:
        """Starts a server in ``directory`` and waits until it answers PING.

        ``tcp=False`` leaves only the unix socket (and the TLS port, with ``tls``).
        ``config`` adds or overrides redis.conf directives (``{"maxmemory": "10mb"}``).
        """
        directory.mkdir(parents=True, exist_ok=True)
        # A unix socket path must fit in 108 bytes; pytest's tmp paths may not.
        sock_dir = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
        conf = {
            "bind": "127.0.0.1",
            "port": str(free_port() if tcp else 0),
            "unixsocket": str(sock_dir / "redis.sock"),
            "unixsocketperm": "700",
            "dir": str(directory),
            "logfile": str(directory / "redis.log"),
            "daemonize": "no",
            "save": '""',
            "appendonly": "no",
            # SIGTERM stops at once: no save, no waiting for replicas to catch up.
            "shutdown-on-sigterm": "nosave now",
        }
        if tls is not None:
            conf |= {
                "tls-port": str(free_port()),
                "tls-cert-file": str(tls.server_cert),
                "tls-key-file": str(tls.server_key),
                "tls-ca-cert-file": str(tls.ca),
                "tls-auth-clients": "optional",
            }
        if password is not None:
            conf |= {"requirepass": password, "masterauth": password}
        if cluster:
            conf |= {
                "cluster-enabled": "yes",
                "cluster-config-file": str(directory / "nodes.conf"),
                "cluster-node-timeout": "1000",
                # Replicas sync at once and may always take over: a test can kill a primary
                # right after start-up and see its replica promoted.
                "repl-diskless-sync-delay": "0",
                "cluster-replica-validity-factor": "0",
                "cluster-port": str(free_port()),
            }
        conf |= config or {}
        server = cls(
            directory=directory,
            port=int(conf["port"]),
            unix_socket=sock_dir / "redis.sock",
            tls_port=int(conf.get("tls-port", 0)),
            password=password,
            config=conf,
        )
        server._spawn()
        return server

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT`` (no password in it)."""
        return f"redis://127.0.0.1:{self.port}"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.unix_socket}"

    @property
    def tls_url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server is not running"
        return self.proc.pid

    def cli(self, *args: str) -> str:
        """Runs one command through ``redis-cli`` on the unix socket; returns its raw output."""
        auth = ["--no-auth-warning", "-a", self.password] if self.password else []
        out = subprocess.run(
            [REDIS_CLI, "-s", str(self.unix_socket), *auth, *args],
            check=True,
            capture_output=True,
            timeout=10,
        )
        return out.stdout.decode()

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: connections drop, nothing is saved."""
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        proc.kill()
        proc.wait(timeout=10)

    def restart(self) -> None:
        """Kills the server if it runs and starts it again on the same ports.

        A standalone server comes back empty; a cluster node keeps its identity (nodes.conf).
        """
        self.kill()
        self._spawn()

    def stop(self) -> None:
        """Stops the server (SIGCONT first, in case a test left it paused) and removes its socket."""
        proc = self.proc
        if proc is not None:
            self.proc = None
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.unix_socket.parent, ignore_errors=True)

    def _spawn(self) -> None:
        conf_file = self.directory / "redis.conf"
        conf_file.write_text("".join(f"{k} {v}\n" for k, v in self.config.items()))
        self.proc = subprocess.Popen(
            [REDIS_SERVER, str(conf_file)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                log = self.directory / "redis.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n{tail}")
            try:
                if self.cli("PING").strip() == "PONG":
                    return
            except subprocess.CalledProcessError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer within {START_TIMEOUT_S} s")
            time.sleep(0.02)


@dataclass
class RedisClusterProcs:
    """A Redis Cluster of ``2 * masters`` processes: every primary has one replica."""

    nodes: list[RedisServer]

    @classmethod
    def start(
        cls, directory: Path, masters: int = 3, password: str | None = None
    ) -> RedisClusterProcs:
        nodes: list[RedisServer] = []
        try:
            for i in range(2 * masters):
                nodes.append(
                    RedisServer.start(directory / f"node{i}", cluster=True, password=password)
                )
            cluster = cls(nodes)
            auth = ["--no-auth-warning", "-a", password] if password else []
            subprocess.run(
                [REDIS_CLI, *auth, "--cluster", "create",
                 *(f"127.0.0.1:{n.port}" for n in nodes),
                 "--cluster-replicas", "1", "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            cluster.wait_until_ok()
        except BaseException:
            for node in nodes:
                node.stop()
            raise
        return cluster

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def masters(self) -> list[RedisServer]:
        """The running nodes that are primaries (and serve slots) right now."""
        out: list[RedisServer] = []
        for node in self.nodes:
            if node.proc is None:
                continue
            role = node.cli("ROLE").split("\n", 1)[0].strip()
            if role == "master" and "cluster_state:ok" in node.cli("CLUSTER", "INFO"):
                out.append(node)
        return out

    def master_of(self, key: bytes) -> RedisServer:
        """The running primary that serves ``key``'s slot."""
        slot = key_slot(key)
        for node in self.masters():
            for line in node.cli("CLUSTER", "NODES").splitlines():
                fields = line.split()
                if "myself" in fields[2] and "master" in fields[2]:
                    for span in fields[8:]:
                        lo, _, hi = span.partition("-")
                        if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                            return node
        raise LookupError(f"no running primary serves slot {slot}")

    def wait_until_ok(self, timeout_s: float = 20.0) -> None:
        """Waits until every running node reports ``cluster_state:ok``, all slots are served
        and every replica is in sync with its primary."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = self._running()
            infos = [n.cli("CLUSTER", "INFO") for n in running]
            replication = [n.cli("INFO", "replication") for n in running]
            if all(
                "cluster_state:ok" in i and "cluster_slots_ok:16384" in i for i in infos
            ) and all("role:master" in r or "master_link_status:up" in r for r in replication):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def _running(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None]
