"""How the tier's cost grows: keys, concurrent clients, a working set larger than RAM.

    kvtier bench scale [--keys 10000,100000,1000000] [--clients 1,2,4,8,16,32] [--json F]

Three parts, each on its own ``kvtier server`` (kvtier.testing.tierproc.TierProcess,
data port on, as the operator renders it), driven through ``TierClient`` over the data port:

- keys: one RAM-only tier filled to each count of ``--keys`` (32-byte keys, values of
  ``--small-bytes``, in Puts of ``--fill-batch`` keys). At each count: the server's RSS
  growth per key less the value bytes (the RAM tier's metadata per key: index, LRU,
  tenant ledger, allocator slack), and p50/p99 of ``--samples`` one-key Lookups and Gets
  of random keys already stored, one at a time from one client.
- clients: one RAM-only tier holding ``--hot-keys`` values of ``--value-kib``; 1..32 client
  processes each Get one random value at a time for ``--seconds``: ops/s, GB/s and the
  p50/p99 of one Get, all clients together.
- working set: a tier whose RAM holds ``--ram-mib`` and whose disk tier holds the rest of
  a working set ``--ws-factor`` times larger (values of ``--value-kib``), against the same
  set on a tier whose RAM holds all of it. One client reads uniformly random keys and
  replaces one in ``--put-every`` (eviction churn: a replaced value lands in RAM and pushes
  another down) for ``--seconds``, in one-second windows: hit rate (of the whole tier, and
  of RAM from the server's counters), ops/s, Get p50/p99.

Prints Markdown; ``--json`` writes the figures. A measurement, not a test: the numbers go
in docs/benchmarks.md with the command that made them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvtier.connector.client import TierClient
from kvtier.connector.errors import TierError
from kvtier.testing.tierproc import TierProcess

KIB, MIB = 1 << 10, 1 << 20
CONNECT_ATTEMPTS = 10


def key(i: int) -> bytes:
    return b"kvtier-bench-scale-key:" + i.to_bytes(9, "big")  # 32 bytes, as a chunk key


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * KIB
    raise RuntimeError(f"no VmRSS for pid {pid}")


def pct(samples: Sequence[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def client(tier: TierProcess) -> TierClient:
    return TierClient(tier.target, data_path="data", timeout_s=120)


def _latencies(call: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        out.append(time.perf_counter() - t)
    return out


# -- keys ------------------------------------------------------------------------------


def _sample_calls(c: TierClient, n: int, samples: int) -> tuple[list[float], list[float]]:
    """Seconds of ``samples`` one-key Lookups, then Gets, of random keys among the first ``n``."""
    rng = random.Random(n)
    lookups = _latencies(lambda: c.lookup([key(rng.randrange(n))]), samples)

    def get_one() -> None:
        if c.get([key(rng.randrange(n))])[0] is None:
            raise RuntimeError("scale: a stored key missed")

    return lookups, _latencies(get_one, samples)


def keys_part(tier: TierProcess, counts: Sequence[int], small: int, batch: int, samples: int) -> list[dict[str, Any]]:
    assert tier.proc is not None
    value = os.urandom(small)
    rows = []
    with client(tier) as c:
        c.put([(key(1 << 71), value)])  # warm: connection, buffers (a key no count reaches)
        base = rss(tier.proc.pid)
        stored = 0
        for n in counts:
            t0 = time.perf_counter()
            while stored < n:
                top = min(n, stored + batch)
                c.put([(key(i), value) for i in range(stored, top)])
                stored = top
            fill_s = time.perf_counter() - t0
            grown = rss(tier.proc.pid) - base
            lookups, gets = _sample_calls(c, n, samples)
            rows.append({
                "keys": n, "rss_growth_bytes": grown, "bytes_per_key": grown / n,
                "metadata_bytes_per_key": grown / n - small, "fill_keys_per_s": (n - (rows[-1]["keys"] if rows else 0)) / fill_s,
                "lookup_p50_us": pct(lookups, 0.5) * 1e6, "lookup_p99_us": pct(lookups, 0.99) * 1e6,
                "get_p50_us": pct(gets, 0.5) * 1e6, "get_p99_us": pct(gets, 0.99) * 1e6,
            })  # fmt: skip
            print(f"[scale] keys {n}: {rows[-1]['metadata_bytes_per_key']:.0f} B/key", file=sys.stderr)
    return rows


# -- clients ---------------------------------------------------------------------------


def _reader(conn: Connection, target: str, hot: int, seconds: float, barrier: Any) -> None:
    try:
        conn.send(_read_for(target, hot, seconds, barrier))
    except Exception as exc:  # reported to the parent: the point counts it, the run goes on
        barrier.abort()
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _read_for(target: str, hot: int, seconds: float, barrier: Any) -> dict[str, Any]:
    lat: list[float] = []
    moved = 0
    with TierClient(target, data_path="data", timeout_s=120) as c:
        for attempt in range(CONNECT_ATTEMPTS):  # 32 processes connecting to a busy 2-core tier
            try:
                c.get([key(0)])
                break
            except TierError:
                if attempt == CONNECT_ATTEMPTS - 1:
                    raise
                time.sleep(1.0)
        rng = random.Random(os.getpid())
        barrier.wait()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            got = c.get([key(rng.randrange(hot))])
            lat.append(time.perf_counter() - t)
            if got[0] is None:
                raise RuntimeError("a hot key missed")
            moved += len(got[0])
            c.recycle(got)
    return {"lat": lat, "bytes": moved}


def clients_part(tier: TierProcess, counts: Sequence[int], hot: int, size: int, seconds: float) -> list[dict[str, Any]]:
    with client(tier) as c:
        value = os.urandom(size)
        for i in range(0, hot, 16):
            c.put([(key(j), value) for j in range(i, min(hot, i + 16))])
    ctx = mp.get_context("spawn")
    rows = []
    for k in counts:
        barrier = ctx.Barrier(k)
        pipes, procs = [], []
        for _ in range(k):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_reader, args=(child, tier.target, hot, seconds, barrier), daemon=True)
            p.start()
            pipes.append(parent)
            procs.append(p)
        got = []
        for pipe in pipes:
            try:
                got.append(pipe.recv() if pipe.poll(seconds + 300) else {"error": "no answer"})
            except EOFError:
                got.append({"error": "the client process died"})
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        errors = [g["error"] for g in got if "error" in g]
        ok = [g for g in got if "error" not in g]
        lat = [x for g in ok for x in g["lat"]]
        if errors:
            print(f"[scale] clients {k}: {len(errors)} failed: {errors[0]}", file=sys.stderr)
        if not lat:
            rows.append({"clients": k, "failed_clients": len(errors), "error": errors[0] if errors else "no Gets"})
            continue
        rows.append({
            "clients": k, "failed_clients": len(errors), "ops_per_s": len(lat) / seconds,
            "gb_per_s": sum(g["bytes"] for g in ok) / seconds / 1e9,
            "get_p50_ms": pct(lat, 0.5) * 1e3, "get_p99_ms": pct(lat, 0.99) * 1e3,
        })  # fmt: skip
        print(f"[scale] clients {k}: {rows[-1]['ops_per_s']:.0f} ops/s", file=sys.stderr)
    return rows


# -- working set larger than RAM --------------------------------------------------------


FILL_DEPTH = 64  # write-behind copies waiting, at most, while the working set is filled


def working_set_part(tier: TierProcess, n: int, size: int, seconds: float, put_every: int) -> dict[str, Any]:
    value = os.urandom(size)
    windows = []
    rng = random.Random(7)
    with client(tier) as c:
        for i in range(0, n, 8):
            c.put([(key(j), value) for j in range(i, min(n, i + 8))])
            # Paced: write-behind to disk is bounded (``--write-behind-*``) and drops what
            # does not fit, so a fill faster than the disk would leave keys in no tier once
            # RAM evicts them, and the arm would measure the fill, not the working set.
            while tier.metric("kvtier_write_behind_queue_depth") > FILL_DEPTH:
                time.sleep(0.005)
        if tier.metric("kvtier_write_behind_dropped_total", tier="disk"):
            raise RuntimeError("scale: the working-set fill dropped write-behind copies")
        ram_hits0 = tier.metric("kvtier_tier_hits_total", tier="ram")
        evict0 = tier.metric("kvtier_tier_evictions_total", tier="ram")
        dropped0 = tier.metric("kvtier_write_behind_dropped_total", tier="disk")
        lat: list[float] = []
        ops = 0
        for _ in range(max(1, round(seconds))):
            asked = hits = 0
            w_lat: list[float] = []
            h0 = tier.metric("kvtier_tier_hits_total", tier="ram")
            end = time.perf_counter() + 1.0
            while time.perf_counter() < end:
                ops += 1
                k = key(rng.randrange(n))
                if ops % put_every == 0:
                    c.put([(k, value)])
                    continue
                t = time.perf_counter()
                got = c.get([k])
                w_lat.append(time.perf_counter() - t)
                asked += 1
                hits += got[0] is not None
                c.recycle(got)
            ram = tier.metric("kvtier_tier_hits_total", tier="ram") - h0
            windows.append({"gets": asked, "hit_rate": hits / max(1, asked), "ram_hit_rate": ram / max(1, asked),
                            "get_p99_ms": pct(w_lat, 0.99) * 1e3 if w_lat else 0.0})  # fmt: skip
            lat += w_lat
        ram_hits = tier.metric("kvtier_tier_hits_total", tier="ram") - ram_hits0
        evictions = tier.metric("kvtier_tier_evictions_total", tier="ram") - evict0
        dropped = tier.metric("kvtier_write_behind_dropped_total", tier="disk") - dropped0
    hit = [w["hit_rate"] for w in windows]
    return {
        "keys": n, "value_bytes": size, "working_set_bytes": n * size, "windows": windows,
        "ops_per_s": ops / len(windows), "hit_rate_min": min(hit), "hit_rate_max": max(hit),
        "ram_hit_rate": ram_hits / max(1, len(lat)), "ram_evictions": evictions, "write_behind_dropped": dropped,
        "get_p50_ms": pct(lat, 0.5) * 1e3, "get_p99_ms": pct(lat, 0.99) * 1e3,
    }  # fmt: skip


# -- the run -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = sorted(int(float(k)) for k in args.keys.split(","))
    clients = sorted(int(k) for k in args.clients.split(","))
    size = int(args.value_kib * KIB)
    ram = int(args.ram_mib * MIB)
    ws_keys = max(4, int(args.ws_factor * ram) // size)
    out: dict[str, Any] = {"config": vars(args) | {"cpus": os.cpu_count(), "load_before": os.getloadavg()}}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-scale-") as d:
        room = max(counts) * (args.small_bytes + 1024) + 256 * MIB
        tier = TierProcess.start(Path(d) / "keys", "--ram-bytes", str(room), "--disk-bytes", "0",
                                 "--max-keys", str(max(4096, args.fill_batch)))  # fmt: skip
        try:
            out["keys"] = keys_part(tier, counts, args.small_bytes, args.fill_batch, args.samples)
        finally:
            tier.stop()
        tier = TierProcess.start(Path(d) / "clients", "--ram-bytes", str(args.hot_keys * size * 2 + 64 * MIB),
                                 "--disk-bytes", "0")  # fmt: skip
        try:
            out["clients"] = clients_part(tier, clients, args.hot_keys, size, args.seconds)
        finally:
            tier.stop()
        out["working_set"] = {}
        for arm, ram_bytes in (("all in RAM", ws_keys * size * 2 + 64 * MIB), (f"{args.ws_factor:g}x RAM", ram)):
            tier = TierProcess.start(Path(d) / arm.replace(" ", "-"), "--ram-bytes", str(ram_bytes),
                                     "--disk-bytes", str(ws_keys * size * 2 + 64 * MIB))  # fmt: skip
            try:
                out["working_set"][arm] = working_set_part(tier, ws_keys, size, args.seconds, args.put_every)
            finally:
                tier.stop()
            print(f"[scale] working set {arm}: done", file=sys.stderr)
    out["load_after"] = os.getloadavg()
    return out


def markdown(r: dict[str, Any]) -> str:
    cfg = r["config"]
    lines = [f"Machine: {cfg['cpus']} CPUs; load average before {cfg['load_before'][0]:.1f}, after {r['load_after'][0]:.1f}.", "",
             f"RAM-tier keys (32-byte keys, {cfg['small_bytes']}-byte values, one client, one key per call):", "",
             "| keys | metadata B/key | Lookup p50 us | Lookup p99 us | Get p50 us | Get p99 us | fill keys/s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for k in r["keys"]:
        lines.append(f"| {k['keys']:,} | {k['metadata_bytes_per_key']:.0f} | {k['lookup_p50_us']:.0f} | "
                     f"{k['lookup_p99_us']:.0f} | {k['get_p50_us']:.0f} | {k['get_p99_us']:.0f} | {k['fill_keys_per_s']:,.0f} |")  # fmt: skip
    lines += ["", f"Concurrent clients (processes; one Get of one {cfg['value_kib']:g} KiB value at a time, "
              f"{cfg['hot_keys']} hot keys, {cfg['seconds']:g} s each):", "",
              "| clients | ops/s | GB/s | Get p50 ms | Get p99 ms | clients failed |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for c in r["clients"]:
        if "error" in c:
            lines.append(f"| {c['clients']} | - | - | - | - | {c['failed_clients']} ({c['error']}) |")
            continue
        lines.append(f"| {c['clients']} | {c['ops_per_s']:,.0f} | {c['gb_per_s']:.2f} | {c['get_p50_ms']:.2f} | "
                     f"{c['get_p99_ms']:.2f} | {c['failed_clients']} |")  # fmt: skip
    lines += ["", f"Working set {cfg['ws_factor']:g}x RAM ({cfg['ram_mib']:g} MiB RAM; {cfg['value_kib']:g} KiB values, "
              f"uniform reads, one Put in {cfg['put_every']}):", "",
              "| arm | keys | ops/s | hit rate (min-max per second) | RAM hit rate | RAM evictions | write-behind dropped | Get p50 ms | Get p99 ms |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for arm, w in r["working_set"].items():
        lines.append(f"| {arm} | {w['keys']} | {w['ops_per_s']:,.0f} | {w['hit_rate_min']:.3f}-{w['hit_rate_max']:.3f} | "
                     f"{w['ram_hit_rate']:.3f} | {w['ram_evictions']:.0f} | {w['write_behind_dropped']:.0f} | {w['get_p50_ms']:.2f} | {w['get_p99_ms']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench scale", description=__doc__.splitlines()[0])
    p.add_argument("--keys", default="10000,100000,1000000", help="key counts, comma-separated")
    p.add_argument("--small-bytes", type=int, default=64, help="value size of the key-count part")
    p.add_argument("--fill-batch", type=int, default=4096, help="keys per Put while filling")
    p.add_argument("--samples", type=int, default=2000, help="Lookups and Gets timed at each key count")
    p.add_argument("--clients", default="1,2,4,8,16,32", help="concurrent client processes, comma-separated")
    p.add_argument("--hot-keys", type=int, default=256, help="values the clients part reads")
    p.add_argument("--value-kib", type=float, default=256, help="value size of the clients and working-set parts")
    p.add_argument("--seconds", type=float, default=3, help="seconds per clients point and per working-set arm")
    p.add_argument("--ram-mib", type=float, default=32, help="RAM tier of the working-set part")
    p.add_argument("--ws-factor", type=float, default=10, help="working set / RAM")
    p.add_argument("--put-every", type=int, default=10, help="one op in this many is a Put (churn)")
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    p.add_argument("--tiny", action="store_true", help="CI smoke run: small counts, short")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    if args.tiny:
        args.keys, args.clients, args.samples, args.hot_keys = "200,1000", "1,3", 50, 8
        args.value_kib, args.seconds, args.ram_mib = 64, 1, 1
    r = run(args)
    print(markdown(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
