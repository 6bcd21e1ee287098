"""Benchmark: the tier data path. GET and PUT of KV chunks through kvtier and its peers, one run.

For every chunk size and number of concurrent clients, each backend (see
``bench.tierpeers``) gets the same work: every client process PUTs batches of a
prompt's chunks, then GETs them back (``--batch-mib`` per batch, at least two
chunks; ``--mib-per-client`` per measurement). Backends take turns inside every
round, and the order rotates from round to round, so load spikes on a shared
machine hit them all. Round 0 warms up and is not counted.

Reported: GB/s (10^9 bytes/s, all clients together, median over rounds), the
ratio to the raw TCP stream (the ceiling here) and to each peer, and the
server's CPU-seconds per GB moved (every server process of the backend). GETs
check each value's length and ends (``--verify``: every byte).

Run: ``.venv/bin/kvtier bench tier`` (results: docs/benchmarks.md, "Tier data path").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvtier.bench import tierpeers
from kvtier.bench.tierpeers import BACKENDS, EXPERIMENTS, Backend

MIB = 1 << 20
OPS = ("GET", "PUT")
SAME_NODE = "kvtier same-node"
PEERS = ("raw TCP", "memcpy", "redis-py", "LMCache", "plain file")
# Issue 18 item 3: a lower tier against its own ceiling, same run, every size and client count,
# reached over the data port and over the same-node transport.
CEILINGS = {
    "kvtier Redis": ("redis-py", 0.9),
    "kvtier disk": ("plain file", 0.8),
    "kvtier Redis same-node": ("redis-py", 0.9),
    "kvtier disk same-node": ("plain file", 0.8),
}


# -- worker processes (one per concurrent client) ------------------------------------


def _worker(conn: Connection, barriers: dict[int, Any], worker_id: int) -> None:
    clients: dict[str, tierpeers.Client] = {}
    payloads: dict[int, bytes] = {}
    while True:
        msg = conn.recv()
        if msg is None:
            break
        try:
            conn.send(_run(msg, clients, payloads, barriers, worker_id))
        except Exception as exc:  # reported to the parent, which stops the run
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
    for c in clients.values():
        c.close()


def _run(msg: dict[str, Any], clients: dict[str, tierpeers.Client], payloads: dict[int, bytes],
         barriers: dict[int, Any], worker_id: int) -> dict[str, Any]:  # fmt: skip
    name, size = msg["backend"], msg["size"]
    client = clients.get(name)
    if client is None:
        client = clients[name] = tierpeers.connect(
            msg["kind"], msg["port"], msg["frame_bytes"], msg["grpc_options"], msg["socket"]
        )
    payload = payloads.get(size)
    if payload is None:
        payloads.clear()  # one size at a time: bounded memory
        payload = payloads[size] = os.urandom(size)
    keys = [f"w{worker_id}-s{size}-{i}".encode() for i in range(msg["chunks"])]
    barriers[msg["clients"]].wait()
    start = time.perf_counter()
    for _ in range(msg["batches"]):
        if msg["op"] == "PUT":
            client.put(keys, payload)
        else:
            values = client.get(keys)
            _check(values, payload, len(keys), msg["verify"])
            client.done(values)
    end = time.perf_counter()
    return {"start": start, "end": end, "bytes": size * len(keys) * msg["batches"]}


def _check(values: list[Any], payload: bytes, n: int, verify: bool) -> None:
    if len(values) != n or any(v is None for v in values):
        raise RuntimeError(f"GET returned {sum(v is not None for v in values)} of {n} values")
    for v in values:
        view = memoryview(v)
        ok = view.nbytes == len(payload) and view[:8] == payload[:8] and view[-8:] == payload[-8:]
        if not ok or (verify and view != payload):
            raise RuntimeError("GET returned a value that differs from what was PUT")


class Workers:
    """``n`` client processes; ``run(clients=k, ...)`` makes the first ``k`` work together."""

    def __init__(self, n: int, counts: Sequence[int]) -> None:
        ctx = mp.get_context("spawn")
        barriers = self.barriers = {k: ctx.Barrier(k) for k in set(counts)}
        self.pipes: list[Connection] = []
        self.procs = []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, barriers, i), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def run(self, clients: int, **msg: Any) -> tuple[float, int]:
        """Seconds from the first client's start to the last one's end, and bytes moved."""
        for pipe in self.pipes[:clients]:
            pipe.send({**msg, "clients": clients})
        results = [pipe.recv() for pipe in self.pipes[:clients]]
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise RuntimeError(f"{msg['backend']} {msg['op']}: {errors[0]}")
        start = min(r["start"] for r in results)
        end = max(r["end"] for r in results)
        return end - start, sum(r["bytes"] for r in results)

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


# -- results ------------------------------------------------------------------------


@dataclass
class Cell:
    backend: str
    op: str
    size_mib: float
    clients: int
    gbps: list[float] = field(default_factory=list)
    bytes: int = 0
    server_cpu_s: float = 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.gbps)

    @property
    def cpu_s_per_gb(self) -> float:
        return self.server_cpu_s / (self.bytes / 1e9) if self.bytes else 0.0


@dataclass
class Results:
    config: dict[str, Any]
    machine: dict[str, Any]
    cells: dict[tuple[str, str, float, int], Cell] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def cell(self, backend: str, op: str, size: float, clients: int) -> Cell | None:
        c = self.cells.get((backend, op, size, clients))
        return c if c is not None and c.gbps else None

    def ratio(self, backend: str, peer: str, op: str, size: float, clients: int) -> float | None:
        a, b = self.cell(backend, op, size, clients), self.cell(peer, op, size, clients)
        return a.median / b.median if a and b and b.median else None

    def goals(self, backend: str = "kvtier RAM") -> list[dict[str, Any]]:
        """The issue's goals for ``backend``, each with the measured ratio and whether it is met."""
        if backend == SAME_NODE:
            return self.same_node_goals()
        if backend in CEILINGS:
            return self.ceiling_goals(backend)
        cfg = self.config
        out: list[dict[str, Any]] = []
        ran = set(self.backends())  # a goal against a baseline left out of the run is not listed
        for op, need in (("GET", 0.6), ("PUT", 0.5)) if "raw TCP" in ran else ():
            for size in (s for s in cfg["sizes_mib"] if 4 <= s <= 16):
                for k in cfg["clients"]:
                    r = self.ratio(backend, "raw TCP", op, size, k)
                    out.append({"goal": f"{op} >= {need:.0%} of raw TCP", "op": op, "size_mib": size,
                                "clients": k, "ratio": r, "met": r is not None and r >= need})  # fmt: skip
        for op in OPS if "redis-py" in ran else ():
            for size in cfg["sizes_mib"]:
                for k in cfg["clients"]:
                    r = self.ratio(backend, "redis-py", op, size, k)
                    out.append({"goal": ">= redis-py", "op": op, "size_mib": size, "clients": k,
                                "ratio": r, "met": r is not None and r >= 1.0})  # fmt: skip
        if 4 in cfg["sizes_mib"] and 64 in cfg["sizes_mib"]:
            for op in OPS:
                for k in cfg["clients"]:
                    a, b = self.cell(backend, op, 64, k), self.cell(backend, op, 4, k)
                    r = a.median / b.median if a and b else None
                    out.append({"goal": "64 MiB >= 0.9x 4 MiB", "op": op, "size_mib": 64, "clients": k,
                                "ratio": r, "met": r is not None and r >= 0.9})  # fmt: skip
        return out

    def same_node_goals(self) -> list[dict[str, Any]]:
        """Issue 18's: same-node GET and PUT at 4, 16 and 64 MiB, 1 and 4 clients, >= 2x the
        raw TCP ceiling and >= 0.5x a memcpy of the same bytes, each in the same run."""
        ran = set(self.backends())
        out: list[dict[str, Any]] = []
        for peer, need in (("raw TCP", 2.0), ("memcpy", 0.5)):
            if peer not in ran:
                continue
            for op in OPS:
                for size in (s for s in self.config["sizes_mib"] if s in (4, 16, 64)):
                    for k in self.config["clients"]:
                        r = self.ratio(SAME_NODE, peer, op, size, k)
                        out.append({"goal": f">= {need:g}x {peer}", "op": op, "size_mib": size, "clients": k,
                                    "ratio": r, "met": r is not None and r >= need})  # fmt: skip
        return out

    def ceiling_goals(self, backend: str) -> list[dict[str, Any]]:
        """Issue 18 item 3: the Redis tier >= 0.9x redis-py to the same kind of redis-server,
        the disk tier >= 0.8x plain file I/O on the same file system, GET and PUT."""
        peer, need = CEILINGS[backend]
        if peer not in set(self.backends()):
            return []
        return [
            {"goal": f">= {need:g}x {peer}", "op": op, "size_mib": size, "clients": k,
             "ratio": (r := self.ratio(backend, peer, op, size, k)), "met": r is not None and r >= need}
            for op in OPS for size in self.config["sizes_mib"] for k in self.config["clients"]
        ]  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        rows = []
        for c in self.cells.values():
            row = {k: v for k, v in asdict(c).items() if k != "bytes"}
            row |= {
                "gbps_median": c.median if c.gbps else None,
                "server_cpu_s_per_gb": c.cpu_s_per_gb,
            }
            row |= {
                f"ratio_to_{p}": self.ratio(c.backend, p, c.op, c.size_mib, c.clients)
                for p in PEERS
            }
            rows.append(row)
        return {"config": self.config, "machine": self.machine, "skipped": self.skipped,
                "results": rows, "goals": {b: self.goals(b) for b in self.backends() if b.startswith("kvtier")}}  # fmt: skip

    def backends(self) -> list[str]:
        return [b for b in self.config["backends"] if b not in self.skipped]

    def markdown(self) -> str:
        cfg = self.config
        backends = self.backends()
        peers = [p for p in PEERS if p in backends]
        lines = [f"Machine: {self.machine['cpus']} CPUs, {self.machine['cpu_model']}; "
                 f"Python {self.machine['python']}; {cfg['rounds']} rounds (+1 warm-up), "
                 f"frame {cfg['frame_bytes'] // 1024} KiB, batch {cfg['batch_mib']} MiB, "
                 f"{cfg['mib_per_client']} MiB per client per measurement.", ""]  # fmt: skip
        for name, why in self.skipped.items():
            lines += [f"Skipped {name}: {why}", ""]
        lines += ["GB/s (median; all clients together):", "",
                  "| op | chunk MiB | clients | " + " | ".join(backends) + " |",
                  "|---|---:|---:|" + "---:|" * len(backends)]  # fmt: skip
        for op, size, k in self._rows():
            vals = [self.cell(b, op, size, k) for b in backends]
            lines.append(
                f"| {op} | {size:g} | {k} | "
                + " | ".join(f"{v.median:.2f}" if v else "-" for v in vals)
                + " |"
            )
        lines += ["", "kvtier against the ceiling and the peers (ratios of medians), server CPU-s per GB:", "",
                  "| op | chunk MiB | clients | tier | GB/s | " + " | ".join(f"/ {p}" for p in peers) + " | server CPU-s/GB |",
                  "|---|---:|---:|---|---:|" + "---:|" * len(peers) + "---:|"]  # fmt: skip
        for op, size, k in self._rows():
            for b in (b for b in backends if b.startswith("kvtier")):
                c = self.cell(b, op, size, k)
                if c is None:
                    continue
                ratios = [self.ratio(b, p, op, size, k) for p in peers]
                lines.append(f"| {op} | {size:g} | {k} | {b.removeprefix('kvtier ')} | {c.median:.2f} | "
                             + " | ".join(f"{r:.2f}" if r is not None else "-" for r in ratios)
                             + f" | {c.cpu_s_per_gb:.2f} |")  # fmt: skip
        lines += ["", "Server CPU-s per GB (every process of the backend's server):", "",
                  "| op | chunk MiB | clients | " + " | ".join(backends) + " |",
                  "|---|---:|---:|" + "---:|" * len(backends)]  # fmt: skip
        for op, size, k in self._rows():
            vals = [self.cell(b, op, size, k) for b in backends]
            lines.append(
                f"| {op} | {size:g} | {k} | "
                + " | ".join(f"{v.cpu_s_per_gb:.2f}" if v else "-" for v in vals)
                + " |"
            )
        for name in (b for b in ("kvtier RAM", SAME_NODE, *CEILINGS) if b in backends):
            lines += ["", f"Goals ({name}):", ""]
            for g in self.goals(name):
                r = "-" if g["ratio"] is None else f"{g['ratio']:.2f}"
                lines.append(f"- {g['goal']}: {g['op']} {g['size_mib']:g} MiB x{g['clients']}: {r} "
                             f"{'met' if g['met'] else 'NOT met'}")  # fmt: skip
        return "\n".join(lines)

    def _rows(self) -> list[tuple[str, float, int]]:
        return [
            (op, s, k)
            for op in OPS
            for s in self.config["sizes_mib"]
            for k in self.config["clients"]
        ]


# -- the run ------------------------------------------------------------------------


class Progress:
    """One line on stderr, rewritten in place on a terminal; a line per step otherwise."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()

    def step(self, text: str) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.started
        line = f"[tier {self.done}/{self.total} {elapsed:5.0f}s] {text}"
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def note(self, text: str) -> None:
        sys.stderr.write(("\r\033[K" if self.tty else "") + text + "\n")
        sys.stderr.flush()

    def end(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def lmcache_python(timeout_s: float) -> tuple[str | None, str]:
    """Builds (once) LMCache's venv with kvtier/bench/lmcache-env; (python, "") or (None, why not)."""
    script = Path(__file__).with_name("lmcache-env")
    try:
        out = subprocess.run(
            ["bash", str(script)], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return (
            None,
            f"kvtier/bench/lmcache-env did not finish within {timeout_s:.0f} s (--lmcache-build-timeout)",
        )
    if out.returncode != 0:
        return None, f"bench/lmcache-env failed ({out.returncode}): {out.stderr.strip()[-500:]}"
    return out.stdout.strip().splitlines()[-1], ""


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import grpc

    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "grpcio": grpc.__version__, "load_avg": os.getloadavg()}  # fmt: skip


def run(args: argparse.Namespace) -> Results:
    sizes = [float(s) for s in args.sizes.split(",")]
    clients = [int(k) for k in args.clients.split(",")]
    backends = [b.strip() for b in args.backends.split(",")] if args.backends else list(BACKENDS)
    for b in backends:
        if b not in BACKENDS + EXPERIMENTS:
            known = ", ".join(BACKENDS + EXPERIMENTS)
            raise SystemExit(f"--backends: unknown backend {b!r}; known: {known}")
    config = {"sizes_mib": sizes, "clients": clients, "rounds": args.repeat, "backends": backends,
              "batch_mib": args.batch_mib, "mib_per_client": args.mib_per_client,
              "frame_bytes": args.frame_bytes, "verify": args.verify}  # fmt: skip
    grpc_options = [_grpc_option(o) for o in args.grpc_option]
    if grpc_options:
        config["grpc_options"] = grpc_options
    results = Results(config, machine())
    total = (args.repeat + 1) * len(sizes) * len(clients) * len(backends) * 2
    progress = Progress(total)
    py = None
    if "LMCache" in backends:
        progress.note("[tier] building/locating LMCache's venv (kvtier/bench/lmcache-env) ...")
        py, why = lmcache_python(args.lmcache_build_timeout)
        if py is None:
            results.skipped["LMCache"] = why
            progress.note(f"[tier] SKIPPING LMCache: {why}")
    running: dict[str, Backend] = {}
    workers = None
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-tier-") as tmp:
        try:
            for name in results.backends():
                progress.note(f"[tier] starting {name}")
                running[name] = tierpeers.start_backend(
                    name,
                    Path(tmp) / name.replace(" ", "-"),
                    frame_bytes=args.frame_bytes,
                    lmcache_python=py,
                    grpc_options=grpc_options,
                )
            workers = Workers(max(clients), clients)
            order = results.backends()
            for rnd in range(args.repeat + 1):
                for size_mib in sizes:
                    size = int(size_mib * MIB)
                    chunks = max(2, int(args.batch_mib * MIB) // size)
                    batches = max(1, round(args.mib_per_client * MIB / (chunks * size)))
                    for k in clients:
                        for name in order:
                            b = running[name]
                            for op in ("PUT", "GET"):  # GET reads what this PUT wrote
                                progress.step(
                                    f"round {rnd}/{args.repeat} {size_mib:g} MiB x{k} {name} {op}"
                                )
                                cpu0 = tierpeers.cpu_seconds(b.pids)
                                seconds, moved = workers.run(
                                    k, backend=name, kind=b.kind, port=b.port, socket=b.socket,
                                    frame_bytes=args.frame_bytes,
                                    grpc_options=grpc_options,
                                    op=op, size=size, chunks=chunks, batches=batches, verify=args.verify,
                                )  # fmt: skip
                                cpu = tierpeers.cpu_seconds(b.pids) - cpu0
                                if rnd == 0:
                                    continue
                                cell = results.cells.setdefault(
                                    (name, op, size_mib, k), Cell(name, op, size_mib, k)
                                )
                                cell.gbps.append(moved / seconds / 1e9)
                                cell.bytes += moved
                                cell.server_cpu_s += cpu
                order = order[1:] + order[:1]
        finally:
            progress.end()
            for b in running.values():
                b.stop()
            if workers is not None:
                workers.close()
    return results


def _grpc_option(text: str) -> tuple[str, int]:
    key, sep, value = text.partition("=")
    if not sep or not value.lstrip("-").isdigit():
        raise SystemExit(
            f"--grpc-option {text!r}: expected KEY=INTEGER, e.g. grpc.http2.max_frame_size=16777215"
        )
    return key, int(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench tier", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,4,16,64", help="chunk sizes in MiB, comma-separated")
    p.add_argument(
        "--clients", default="1,4", help="numbers of concurrent clients, comma-separated"
    )
    p.add_argument(
        "--repeat", type=int, default=5, help="measured rounds (after one warm-up round)"
    )
    p.add_argument(
        "--backends",
        default="",
        help=f"comma-separated, of: {', '.join(BACKENDS)} (default: all); "
        f"experiments, run only when named: {', '.join(EXPERIMENTS)}",
    )
    p.add_argument(
        "--batch-mib",
        type=float,
        default=64,
        help="bytes of one batch (a prompt's chunks; at least 2 chunks)",
    )
    p.add_argument(
        "--mib-per-client", type=float, default=256, help="bytes each client moves per measurement"
    )
    p.add_argument(
        "--frame-bytes", type=int, default=4 * MIB, help="kvtier frame size (server and client)"
    )
    p.add_argument(
        "--grpc-option",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="extra gRPC channel argument for kvtier's server and clients (an experiment; repeatable)",
    )
    p.add_argument("--verify", action="store_true", help="compare every byte of every GET")
    p.add_argument(
        "--lmcache-build-timeout",
        type=float,
        default=900,
        help="seconds allowed to build LMCache's venv",
    )
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument(
        "--tiny", action="store_true", help="CI smoke run: small sizes, 1 round, every byte checked"
    )
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    # SIGTERM unwinds like Ctrl-C: every server this run started is stopped by its PID.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.tiny:
        args.sizes, args.clients, args.repeat = "0.25,1", "1,2", 1
        args.batch_mib, args.mib_per_client, args.verify = 2, 2, True
        args.frame_bytes = min(args.frame_bytes, 256 << 10)  # values span several frames
    results = run(args)
    print(results.markdown())
    if args.json:
        args.json.write_text(json.dumps(results.to_json(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
