"""The stores ``kvtier bench tier`` measures: their server processes and their clients.

Each backend is a ``Backend`` (how to start its servers, which PIDs to charge
server CPU to) and a client adapter with two calls, ``put(keys, value)`` and
``get(keys) -> values``, each moving one batch (a prompt's chunks):

- ``raw TCP``: ``bench.rawtcp``, the ceiling: one stream, fixed header, no framing,
  receiving into reused memory on both ends.
- ``redis-py``: redis-py with hiredis, a pipeline of SET / GET per batch, straight
  to a local ``redis-server``.
- ``LMCache``: LMCache's own remote server (``python -m lmcache.v1.server``, from
  the venv that ``kvtier/bench/lmcache-env`` builds), spoken to with its client protocol
  (``lmcache.v1.protocol``: a 186-byte ``ClientMetaMessage``, then the bytes;
  GET answers a 36-byte ``ServerMetaMessage``, then the bytes). Like LMCache's
  own ``LMCServerConnector``, GETs go one at a time; PUTs have no reply, so a
  batch ends with a HEALTH round trip (the server handles a connection's
  commands in order: its answer means every PUT before it is stored).
- ``kvtier RAM`` / ``kvtier disk`` / ``kvtier Redis``: ``kvtier server`` through
  ``kvtier.connector.client.TierClient``, values over the tier's data port
  (``--data-port``; the client is told to require it). The disk and Redis rows
  give the RAM tier 1 byte (every value lands in and is read from the lower
  tier) and write through, so a PUT returns once the lower tier holds the value.
- ``kvtier RAM gRPC``: the same RAM tier with values over gRPC (no data port).
- ``kvtier same-node``: the same RAM tier over the same-node transport
  (``--local-socket``: control messages on a Unix socket, values through the tier's
  shared memfd segments; the client is told to require it). The tier gets
  ``--incoming-bytes 1GiB``: each client connection holds a staging segment of twice
  its largest value from that budget (4 clients x 2 x 64 MiB).
- ``kvtier disk same-node`` / ``kvtier Redis same-node``: the disk and Redis rows'
  tiers over the same-node transport: what an engine beside a per-node tier gets
  from its lower tiers (a value not held by the RAM tier reaches the client inline
  on the socket, docs/protocol.md, "Same-node transport").
- ``plain file``: no server: each client process writes every value to a file of its
  own (open, write, close; no fsync, as the disk tier's default) and reads it back
  (open, ``readinto`` a buffer given back and reused, close), in a directory beside
  the disk tier's on the same file system: the ceiling of the disk tier.
- ``memcpy``: no server: each client process copies the same bytes in its own memory,
  a PUT into a buffer kept per key, a GET from it into a buffer given back (recycled),
  as the kvtier clients' GETs are: the ceiling of any copy-out transport.

The kvtier and raw TCP clients give the values of each GET back once checked
(``TierClient.recycle``, as the connector's worker does once a load is copied into
the KV cache; ``RawClient.recycle``), so later GETs receive into that memory (the
kvtier clients keep up to ``RECEIVE_POOL_BYTES``: a batch of every size, as the raw
TCP, memcpy and plain file clients keep a spare of every size they saw);
redis-py's and LMCache's clients allocate each value (they have no such call).

An experiment, run only when ``--backends`` names it: ``kvtier RAM no-recycle``,
the RAM tier with ``--ram-recycle-bytes 0`` (every PUT receives into fresh
memory) and a client that receives every GET value into fresh memory
(``receive_buffer_bytes=0``): the baseline of the recycled buffers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 300.0

BACKENDS = (
    "raw TCP",
    "memcpy",
    "redis-py",
    "LMCache",
    "kvtier RAM",
    "kvtier same-node",
    "kvtier RAM gRPC",
    "plain file",
    "kvtier disk",
    "kvtier Redis",
    "kvtier disk same-node",
    "kvtier Redis same-node",
)
EXPERIMENTS = ("kvtier RAM no-recycle",)  # run only when named in --backends
# The kvtier clients' pool of received buffers: room for a batch of every size a run
# measures, as the baselines keep a spare of every size they saw (an engine's pool holds
# one size, its chunks', and the connector's default 256 MiB is plenty for that; a run
# that rotates through four sizes would otherwise receive each size's first batch into
# new memory, which costs more than the bytes: docs/benchmarks.md, "Same-node copies").
RECEIVE_POOL_BYTES = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {START_TIMEOUT_S:.0f} s")


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


@dataclass
class Backend:
    """One store under test: its server processes (stopped by PID) and where it listens."""

    name: str
    # client adapter: "raw", "memcpy", "redis", "lmcache", "kvtier" (data port), "kvtier-grpc",
    # "kvtier-fresh" (data port, the client receives every value into fresh memory),
    # "kvtier-local" (the same-node transport on ``socket``), "file" (plain files in ``socket``)
    kind: str
    port: int = 0
    socket: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def spawn(self, args: list[str], log: Path, what: str, port: int, **kw: Any) -> None:
        with log.open("ab") as out:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, **kw
            )
        self.procs.append(proc)
        _wait_port(port, proc, what, log)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        self.procs.clear()


def start_redis(backend: Backend, directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(directory),
            "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--shutdown-on-sigterm", "nosave now"]  # fmt: skip
    backend.spawn(args, directory / "redis.log", "redis-server", port)
    return port


def start_backend(
    name: str,
    directory: Path,
    *,
    frame_bytes: int,
    lmcache_python: str | None,
    grpc_options: Sequence[tuple[str, int]] = (),
) -> Backend:
    """Starts ``name``'s servers on free 127.0.0.1 ports under ``directory``.

    ``grpc_options`` are added to the kvtier server's channel arguments (an experiment knob).
    """
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "server.log"
    if name == "raw TCP":
        b = Backend(name, "raw", free_port())
        code = f"from kvtier.bench.rawtcp import serve; serve('127.0.0.1', {b.port})"
        b.spawn([sys.executable, "-c", code], log, "the raw TCP server", b.port, cwd=directory)
        return b
    if name == "memcpy":
        return Backend(name, "memcpy")
    if name == "plain file":
        files = directory / "files"
        files.mkdir(parents=True, exist_ok=True)
        return Backend(name, "file", socket=str(files))
    if name == "redis-py":
        b = Backend(name, "redis")
        b.port = start_redis(b, directory)
        return b
    if name == "LMCache":
        if lmcache_python is None:
            raise RuntimeError("no LMCache venv")
        b = Backend(name, "lmcache", free_port())
        args = [lmcache_python, "-m", "lmcache.v1.server", "127.0.0.1", str(b.port)]
        b.spawn(args, log, "LMCache's server", b.port, cwd=directory)
        return b
    kind = {
        "kvtier RAM gRPC": "kvtier-grpc",
        "kvtier RAM no-recycle": "kvtier-fresh",
        "kvtier same-node": "kvtier-local",
        "kvtier disk same-node": "kvtier-local",
        "kvtier Redis same-node": "kvtier-local",
    }.get(name, "kvtier")
    b = Backend(name, kind, free_port())
    flags = ["--host", "127.0.0.1", "--port", str(b.port), "--metrics-port", "0",
             "--frame-bytes", str(frame_bytes), "--log-level", "warning",
             "--tier-timeout", "60s", "--grace-period", "1s"]  # fmt: skip
    if b.kind in ("kvtier", "kvtier-fresh"):
        flags += ["--data-port", str(free_port())]
    if b.kind == "kvtier-local":
        b.socket = str(directory / "tier.sock")
        flags += ["--local-socket", b.socket, "--incoming-bytes", "1GiB"]
    if name in ("kvtier RAM", "kvtier RAM gRPC", "kvtier RAM no-recycle", "kvtier same-node"):
        flags += ["--ram-bytes", "8GiB", "--disk-bytes", "0"]
        if name == "kvtier RAM no-recycle":
            flags += ["--ram-recycle-bytes", "0"]
    elif name in ("kvtier disk", "kvtier disk same-node"):
        flags += ["--ram-bytes", "1", "--disk-dir", str(directory / "disk"),
                  "--disk-bytes", "16GiB", "--write-policy", "write-through"]  # fmt: skip
    elif name in ("kvtier Redis", "kvtier Redis same-node"):
        redis_port = start_redis(b, directory / "redis")
        flags += ["--ram-bytes", "1", "--disk-bytes", "0", "--write-policy", "write-through",
                  "--redis-url", f"redis://127.0.0.1:{redis_port}", "--redis-timeout", "60s"]  # fmt: skip
    else:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS + EXPERIMENTS)}")
    # kvtier server's main, with extra channel arguments appended to the server's own.
    code = ("import sys; import kvtier.cacheserver.server as s; base = s.grpc_options; "
            f"s.grpc_options = lambda st: [*base(st), *{list(grpc_options)!r}]; "
            "from kvtier.cacheserver.cli import main; sys.exit(main(sys.argv[1:]))")  # fmt: skip
    args = [sys.executable, "-c", code, *flags]
    b.spawn(args, log, "kvtier server", b.port, cwd=directory)
    return b


# -- clients (one per backend in every worker process) -------------------------------


class Client(Protocol):
    def put(self, keys: Sequence[bytes], value: bytes) -> None: ...
    def get(self, keys: Sequence[bytes]) -> list[Any]: ...
    def done(self, values: list[Any]) -> None: ...
    def close(self) -> None: ...


class _Adapter:
    def done(self, values: list[Any]) -> None:
        """The caller is done with a GET's values (a client may reuse their memory)."""


class RawAdapter(_Adapter):
    def __init__(self, port: int) -> None:
        from kvtier.bench.rawtcp import RawClient

        self.c = RawClient("127.0.0.1", port)

    def put(self, keys: Sequence[bytes], value: bytes) -> None:
        self.c.put([(k, value) for k in keys])

    def get(self, keys: Sequence[bytes]) -> list[Any]:
        return self.c.get(keys)

    def done(self, values: list[Any]) -> None:
        self.c.recycle(values)

    def close(self) -> None:
        self.c.close()


class MemcpyAdapter(_Adapter):
    """The same bytes copied in this process: PUT into a buffer kept per key, GET out of it
    into a buffer given back (``done``), reused as the kvtier clients' receive buffers are."""

    def __init__(self) -> None:
        self.stored: dict[bytes, bytearray] = {}
        self.spares: dict[int, list[bytearray]] = {}

    def put(self, keys: Sequence[bytes], value: bytes) -> None:
        for k in keys:
            buf = self.stored.get(k)
            if buf is None or len(buf) != len(value):
                buf = self.stored[k] = bytearray(len(value))
            memoryview(buf)[:] = value

    def get(self, keys: Sequence[bytes]) -> list[Any]:
        out: list[Any] = []
        for k in keys:
            src = self.stored[k]
            free = self.spares.get(len(src))
            dst = free.pop() if free else bytearray(len(src))
            memoryview(dst)[:] = src
            out.append(dst)
        return out

    def done(self, values: list[Any]) -> None:
        for v in values:
            self.spares.setdefault(len(v), []).append(v)

    def close(self) -> None:
        self.stored.clear()
        self.spares.clear()


class FileAdapter(_Adapter):
    """Plain sequential file I/O in ``directory``: a PUT writes each value to its key's file,
    a GET reads each file whole into a buffer given back (``done``) and reused."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.spares: dict[int, list[bytearray]] = {}

    def put(self, keys: Sequence[bytes], value: bytes) -> None:
        for k in keys:
            with open(self.directory / k.hex(), "wb") as f:
                f.write(value)

    def get(self, keys: Sequence[bytes]) -> list[Any]:
        out: list[Any] = []
        for k in keys:
            with open(self.directory / k.hex(), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                free = self.spares.get(size)
                dst = free.pop() if free else bytearray(size)
                view, got = memoryview(dst), 0
                while got < size:
                    n = f.readinto(view[got:])
                    if not n:
                        raise RuntimeError("plain file: short read")
                    got += n
            out.append(dst)
        return out

    def done(self, values: list[Any]) -> None:
        for v in values:
            self.spares.setdefault(len(v), []).append(v)

    def close(self) -> None:
        self.spares.clear()


class RedisAdapter(_Adapter):
    def __init__(self, port: int) -> None:
        import redis

        self.r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=CALL_TIMEOUT_S)

    def put(self, keys: Sequence[bytes], value: bytes) -> None:
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.set(k, value)
        pipe.execute()

    def get(self, keys: Sequence[bytes]) -> list[Any]:
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        return list(pipe.execute())

    def close(self) -> None:
        self.r.close()


# lmcache.v1.protocol (0.5.6): ClientMetaMessage "iiiiiiiii150s", ServerMetaMessage "iiiiiiiii".
_LMC_REQ = struct.Struct("iiiiiiiii150s")
_LMC_REPLY = struct.Struct("iiiiiiiii")
_LMC_PUT, _LMC_GET, _LMC_HEALTH = 1, 2, 5
_LMC_SUCCESS = 200
_LMC_FMT_KV_2LTD, _LMC_UINT8 = 1, 6


class LMCacheAdapter(_Adapter):
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.settimeout(CALL_TIMEOUT_S)

    @staticmethod
    def _key(key: bytes) -> bytes:
        # A CacheEngineKey string: model@world_size@worker_id@chunk_hash(hex)@dtype.
        return f"bench@1@0@{key.hex()}@half".encode().ljust(150)

    def _header(self, command: int, key: bytes, length: int) -> bytes:
        return _LMC_REQ.pack(
            command, length, _LMC_FMT_KV_2LTD, _LMC_UINT8, 0, length, 0, 0, 0, self._key(key)
        )

    def put(self, keys: Sequence[bytes], value: bytes) -> None:
        for k in keys:
            self.sock.sendall(self._header(_LMC_PUT, k, len(value)))
            self.sock.sendall(value)
        self.sock.sendall(self._header(_LMC_HEALTH, b"\0", 0))
        code = _LMC_REPLY.unpack(_recv(self.sock, _LMC_REPLY.size))[0]
        if code != _LMC_SUCCESS:
            raise RuntimeError(f"LMCache HEALTH answered {code}")

    def get(self, keys: Sequence[bytes]) -> list[Any]:
        out: list[Any] = []
        for k in keys:
            self.sock.sendall(self._header(_LMC_GET, k, 0))
            code, length, *_ = _LMC_REPLY.unpack(_recv(self.sock, _LMC_REPLY.size))
            out.append(_recv(self.sock, length) if code == _LMC_SUCCESS else None)
        return out

    def close(self) -> None:
        self.sock.close()


def _recv(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("the server closed the connection")
        got += k
    return buf


class KvtierAdapter:
    def __init__(
        self,
        port: int,
        frame_bytes: int,
        grpc_options: Sequence[tuple[str, int]] = (),
        data_path: str = "data",
        recycle: bool = True,
        local_socket: str | None = None,
    ) -> None:
        import grpc

        from kvtier.connector.client import TierClient

        channel = grpc.insecure_channel
        if grpc_options:  # an experiment knob: TierClient takes no channel arguments
            grpc.insecure_channel = lambda t, options=(): channel(t, [*options, *grpc_options])  # type: ignore[assignment]
        try:
            self.c = TierClient(
                f"127.0.0.1:{port}",
                timeout_s=CALL_TIMEOUT_S,
                frame_bytes=frame_bytes,
                data_path=data_path,
                local_socket=local_socket,
                receive_buffer_bytes=RECEIVE_POOL_BYTES if recycle else 0,
            )
        finally:
            grpc.insecure_channel = channel

    def put(self, keys: Sequence[bytes], value: bytes) -> None:
        stored = self.c.put([(k, value) for k in keys])
        if stored != len(keys):
            raise RuntimeError(f"kvtier stored {stored} of {len(keys)} values")

    def get(self, keys: Sequence[bytes]) -> list[Any]:
        return self.c.get(keys)

    def done(self, values: list[Any]) -> None:
        self.c.recycle(values)  # as the connector's worker does after a load

    def close(self) -> None:
        self.c.close()


def connect(
    kind: str,
    port: int,
    frame_bytes: int,
    grpc_options: Sequence[tuple[str, int]] = (),
    socket_path: str = "",
) -> Client:
    if kind == "raw":
        return RawAdapter(port)
    if kind == "memcpy":
        return MemcpyAdapter()
    if kind == "file":
        return FileAdapter(socket_path)
    if kind == "kvtier-local":
        return KvtierAdapter(port, frame_bytes, grpc_options, "local", local_socket=socket_path)
    if kind == "redis":
        return RedisAdapter(port)
    if kind == "lmcache":
        return LMCacheAdapter(port)
    data_path = "grpc" if kind == "kvtier-grpc" else "data"
    return KvtierAdapter(port, frame_bytes, grpc_options, data_path, recycle=kind != "kvtier-fresh")


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time of ``pids`` (all their threads) so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / tick
