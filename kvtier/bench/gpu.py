"""The connector's KV copies on a GPU: correctness through a real tier, copy rates, overlap.

    python -m kvtier.bench.gpu [--device cuda] [--out gpu.json] [--layer-ms 1.0] [--quick]
    (or kvtier bench gpu ...)

Needs torch (with CUDA for ``--device cuda``), the connector and a ``kvtier server``
it starts itself on 127.0.0.1; no vLLM. For each KV cache configuration below, laid
out as vLLM 0.32 allocates it (``kv.layouts.allocate``: the order's strides, one
backing buffer) on the device:

1. **bytes**: engine A saves chunks through the worker (side-stream copies into pinned
   host memory, the background sender, the tier's data port), engine B, with another
   physical order, loads them back through the worker (Get into pinned receive buffers,
   verification, side-stream copies), and every loaded block is compared with A's.
2. **copy rates**: the worker's copies alone (``KVCopier``, chunks already in pinned host
   memory), timed with events on its copy streams, against the machine's own pinned
   (and pageable) host<->device copy rate of one large tensor.
3. **overlap**: a simulated forward pass (per layer, bf16 matmuls of about
   ``--layer-ms``) with the step's loads and saves: no copies; layerwise (the default:
   each layer waits for its own loads, saves follow each layer); whole step
   (``layerwise: false``: the forward waits for all loads first, saves after the last
   layer); on the engine's stream (copies serialised with the forward, as synchronous
   copies would be). Reported: each forward's time and what the copies added to it.

Writes every figure to ``--out`` as JSON and prints a summary. ``--device cpu`` runs
the same code on the CPU (copies on threads; for a smoke test: tests/bench/test_gpu.py).

On the project's device machine (an H200 with torch, no vLLM, no network) the tier's
Python packages not in its image travel as wheels (``scripts/gpu-wheels`` downloads
them into ``.whl/``); the command, with ``.whl`` carried::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/proto:$PWD/cacheserver:$PWD/connector:$PWD \\
      && PYTHONUNBUFFERED=1 python3 -m kvtier.bench.gpu --out $OUT/gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.connector.kv.copies import KVCopier, LoadChunk
from kvtier.connector.kv.layouts import BlockView, KVContent, KVOrder, allocate
from kvtier.connector.kv.streams import CopyStreams, CudaStream
from kvtier.testing.kvengine import KVEngine, load_plan, save_plan
from kvtier.testing.tierproc import TierProcess

GIB = 1 << 30


@dataclass(frozen=True)
class Config:
    name: str
    save_order: str
    load_order: str
    content: KVContent
    layers: int
    chunk_blocks: int


def configs(quick: bool) -> list[Config]:
    if quick:  # the CPU smoke test: the same code on small caches
        small = KVContent("kv", 2, 16, 64, 64, "bfloat16")
        return [
            Config("tiny-kv", "LBNHC", "LBHNC", small, 4, 4),
            Config("tiny-mla", "BLHNC", "LBNHC", KVContent("mla", 1, 16, 96, 0, "bfloat16"), 3, 4),
        ]
    llama = KVContent("kv", 8, 16, 128, 128, "bfloat16")  # Llama-3-8B, one rank
    return [
        Config("llama3-8b flash_attn->flashinfer", "LBNHC", "LBHNC", llama, 32, 16),
        Config("llama3-8b flashinfer->cross-layer", "LBHNC", "BLHNC", llama, 32, 16),
        Config("llama3-70b tp8 flash_attn", "LBNHC", "BLNHC", KVContent("kv", 1, 16, 128, 128, "bfloat16"), 80, 16),
        Config("deepseek-v3 mla", "LBNHC", "BLHNC", KVContent("mla", 1, 64, 576, 0, "bfloat16"), 61, 4),
    ]


class Clock:
    """Elapsed time of work on a stream: CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self, stream: Any = None) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream())
        return event

    def ms(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return (end - start) * 1e3
        end.synchronize()
        return float(start.elapsed_time(end))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def streams_for(device: torch.device, mode: str) -> tuple[CopyStreams, Any, Any]:
    """The worker's streams for ``mode`` and the raw load/save streams (for timing)."""
    if device.type != "cuda":
        if mode == "engine-stream":
            return CopyStreams.inline(), None, None
        threads = CopyStreams.threads()
        return threads, None, None
    if mode == "engine-stream":
        current = CudaStream(None)
        return CopyStreams(current, current, current), None, None
    loads, saves = torch.cuda.Stream(device), torch.cuda.Stream(device)
    return CopyStreams(CudaStream(None), CudaStream(loads), CudaStream(saves)), loads, saves


def host_copy_rates(device: torch.device, nbytes: int, clock: Clock) -> dict[str, float]:
    """GB/s of one large host<->device copy: pinned and pageable host memory."""
    if device.type != "cuda":
        return {}
    out: dict[str, float] = {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for kind in ("pinned", "pageable"):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
        for direction in ("h2d", "d2h"):
            times = []
            for _ in range(6):
                start = clock.mark()
                if direction == "h2d":
                    dev.copy_(host, non_blocking=True)
                else:
                    host.copy_(dev, non_blocking=True)
                times.append(clock.ms(start, clock.mark()))
            out[f"{kind}_{direction}_gbps"] = nbytes / (statistics.median(times[1:]) * 1e6)
    return out


class Forward:
    """A simulated forward pass: per layer, bf16 matmuls taking about ``layer_ms``."""

    def __init__(self, device: torch.device, layers: int, layer_ms: float, clock: Clock) -> None:
        size = 4096 if device.type == "cuda" else 256
        self.a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        self.layers = layers
        start = clock.mark()
        for _ in range(20):
            torch.matmul(self.a, self.b, out=self.out)
        one = clock.ms(start, clock.mark()) / 20
        self.repeats = max(1, round(layer_ms / max(one, 1e-6)))
        self.layer_ms = one * self.repeats

    def layer(self) -> None:
        for _ in range(self.repeats):
            torch.matmul(self.a, self.b, out=self.out)


def copier_on(cfg: Config, device: torch.device, blocks: int, mode: str) -> tuple[KVCopier, list[torch.Tensor], Any, Any]:
    """The worker's copier on a fresh cache of ``cfg.load_order``, its streams for ``mode``."""
    streams, loads, saves = streams_for(device, mode)
    caches = allocate(KVOrder.named(cfg.load_order), cfg.content, layers=cfg.layers, blocks=blocks, device=device)
    copier = KVCopier([BlockView(c, blocks) for c in caches], dtype=caches[0].dtype, streams=streams)
    return copier, caches, loads, saves


def host_chunks(cfg: Config, chunks: int, pinned: bool) -> list[memoryview]:
    """``chunks`` payloads of random bytes in host memory (pinned on a GPU)."""
    nbytes = cfg.layers * cfg.chunk_blocks * cfg.content.page_bytes
    host = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8) for _ in range(chunks)]
    return [memoryview((h.pin_memory() if pinned else h).numpy()) for h in host]


def chunk_blocks(cfg: Config, chunks: int, first: int = 0) -> list[tuple[int, ...]]:
    return [tuple(range(first + i * cfg.chunk_blocks, first + (i + 1) * cfg.chunk_blocks)) for i in range(chunks)]


def overlap(
    cfg: Config, device: torch.device, clock: Clock, forward: Forward, chunks: int, blocks: int
) -> dict[str, Any]:
    """Forward times with this step's loads and saves, by copy mode: ``none`` (no copies),
    ``layerwise``, ``whole-step`` (layerwise: false) and ``engine-stream`` (copies on the
    forward's own stream)."""
    results: dict[str, float] = {}
    for mode in ("none", "layerwise", "whole-step", "engine-stream"):
        copier, caches, _, _ = copier_on(cfg, device, blocks, mode)
        for layer in caches:  # what the forward leaves in the blocks it saves
            layer.copy_(torch.randint(0, 250, layer.shape, device=device).to(layer.dtype))
        payloads = host_chunks(cfg, chunks, copier.pinned)
        loads = chunk_blocks(cfg, chunks)
        saves = chunk_blocks(cfg, chunks, first=chunks * cfg.chunk_blocks)
        times = []
        for run in range(4):
            copier.new_step()
            clock.sync()
            start = clock.mark()
            if mode != "none":
                copier.load([LoadChunk(p, cfg.chunk_blocks, 0, ids) for p, ids in zip(payloads, loads, strict=True)], [])
                copier.save(saves)
                if mode != "layerwise":
                    copier.wait_loads()
            for layer in range(cfg.layers):
                if mode == "layerwise":
                    copier.wait_layer(layer)
                forward.layer()
                if mode == "layerwise":
                    copier.save_layer(layer)
            saved = copier.finish_saves() if mode != "none" else []
            times.append(clock.ms(start, clock.mark()))
            copier.release(wait=True)
            if run == 0 and saved:  # the saves hold the blocks' bytes, the loads the chunks'
                index = torch.tensor(saves[0], device=device)
                expected = torch.stack([c.index_select(0, index) for c in caches]).cpu()
                assert torch.equal(saved[0].cpu().view(torch.uint8), expected.view(torch.uint8)), mode
                index = torch.tensor(loads[0], device=device)
                got = torch.stack([c.index_select(0, index) for c in caches]).cpu()
                assert bytes(got.view(torch.uint8).reshape(-1).numpy()) == bytes(payloads[0]), mode
        results[mode] = statistics.median(times[1:])
        copier.close()
        del caches
    base = results["none"]
    return {
        "forward_ms": {k: round(v, 3) for k, v in results.items()},
        "added_ms": {k: round(v - base, 3) for k, v in results.items() if k != "none"},
    }


def copy_rates(cfg: Config, device: torch.device, clock: Clock, chunks: int, blocks: int) -> dict[str, float]:
    """GB/s of the worker's copies alone (no forward), per direction, timed on its streams."""
    copier, _, loads, saves = copier_on(cfg, device, blocks, "layerwise")
    payloads = host_chunks(cfg, chunks, copier.pinned)
    ids = chunk_blocks(cfg, chunks)
    nbytes = chunks * cfg.layers * cfg.chunk_blocks * cfg.content.page_bytes
    h2d, d2h = [], []
    for _ in range(4):
        clock.sync()
        copier.new_step()
        start = clock.mark(loads)
        copier.load([LoadChunk(p, cfg.chunk_blocks, 0, b) for p, b in zip(payloads, ids, strict=True)], [])
        h2d.append(clock.ms(start, clock.mark(loads) if clock.cuda else _loaded(copier)))
        clock.sync()
        start = clock.mark(saves)
        copier.save(ids)
        copier.finish_saves()  # returns once the copies completed
        d2h.append(clock.ms(start, clock.mark(saves)))
        copier.release(wait=True)
    copier.close()
    return {
        "bytes_per_step": nbytes,
        "worker_h2d_gbps": round(nbytes / (statistics.median(h2d[1:]) * 1e6), 2),
        "worker_d2h_gbps": round(nbytes / (statistics.median(d2h[1:]) * 1e6), 2),
    }


def _loaded(copier: KVCopier) -> float:
    """The wall clock once the copier's loads completed (the CPU: no events to time)."""
    copier.wait_loads()
    return time.perf_counter()


def through_tier(cfg: Config, tier: TierProcess, device: torch.device, chunks: int, blocks: int) -> dict[str, Any]:
    """Save through engine A's worker, load through B's (another order), compare bytes."""
    threads = device.type != "cuda"
    a = KVEngine(
        tier.target, cfg.save_order, cfg.content, layers=cfg.layers, blocks=blocks,
        chunk_blocks=cfg.chunk_blocks, device=device, save_queue_chunks=max(64, chunks),
        save_timeout_s=120.0,
        streams=CopyStreams.threads() if threads else None,
    )  # fmt: skip
    b = KVEngine(
        tier.target, cfg.load_order, cfg.content, layers=cfg.layers, blocks=blocks,
        chunk_blocks=cfg.chunk_blocks, device=device, load_timeout_s=60.0,
        streams=CopyStreams.threads() if threads else None,
    )  # fmt: skip
    try:
        values = a.fill(seed=1)
        keys = [os.urandom(32) for _ in range(chunks)]
        src = [list(range(blocks - 1 - i * cfg.chunk_blocks, blocks - 1 - (i + 1) * cfg.chunk_blocks, -1)) for i in range(chunks)]
        dst = [list(range(i * cfg.chunk_blocks, (i + 1) * cfg.chunk_blocks)) for i in range(chunks)]
        started = time.perf_counter()
        assert a.step(save_plan(*zip(keys, src, strict=True))) == set()
        assert a.worker.sender.flush(120.0)
        saved_s = time.perf_counter() - started
        started = time.perf_counter()
        failed = b.step(load_plan(*zip(keys, dst, strict=True)))
        if device.type == "cuda":
            torch.cuda.synchronize()
        loaded_s = time.perf_counter() - started
        equal = not failed and all(
            torch.equal(b.blocks(d), values[:, s]) for s, d in zip(src, dst, strict=True)
        )
        untouched = not b.blocks(list(range(chunks * cfg.chunk_blocks, blocks))).any()
        nbytes = chunks * cfg.layers * cfg.chunk_blocks * cfg.content.page_bytes
        counts = {**a.recorder.totals(), **b.recorder.totals()}
        return {
            "chunks": chunks,
            "saved_chunks": counts.get("saved_chunks", 0),
            "loaded_chunks": counts.get("loaded_chunks", 0),
            "errors": {k: v for k, v in counts.items() if k.startswith(("errors", "saves_dropped", "corrupt"))},
            "chunk_bytes": nbytes // chunks,
            "bytes_equal": bool(equal),
            "other_blocks_untouched": bool(untouched),
            "failed_blocks": len(failed),
            "save_step_and_put_gbps": round(nbytes / saved_s / 1e9, 2),
            "get_verify_load_gbps": round(nbytes / loaded_s / 1e9, 2),
            "receive_buffers_pinned": b.worker.copier.pinned,
        }
    finally:
        a.close()
        b.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("gpu.json"))
    parser.add_argument("--layer-ms", type=float, default=1.0, help="simulated compute per layer")
    parser.add_argument("--quick", action="store_true", help="tiny caches (the CPU smoke test)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    started = time.perf_counter()
    clock = Clock(device)
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, "-m", "kvtier.bench.gpu", *(argv if argv is not None else sys.argv[1:])]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host_copy": host_copy_rates(device, GIB if not args.quick else 64 << 20, clock),
        "configs": [],
    }
    chunks = 2 if args.quick else 16
    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-") as tmp:
        tier = TierProcess.start(
            Path(tmp), "--ram-bytes", "12GiB", "--disk-bytes", "0", "--incoming-bytes", "2GiB",
            "--max-value-bytes", "256MiB", data_port=True,
        )  # fmt: skip
        try:
            for cfg in configs(args.quick):
                blocks = 2 * chunks * cfg.chunk_blocks + 8
                forward = Forward(device, cfg.layers, args.layer_ms if not args.quick else 0.2, clock)
                entry: dict[str, Any] = {
                    "name": cfg.name, "save_order": cfg.save_order, "load_order": cfg.load_order,
                    "content": cfg.content.family, "layers": cfg.layers,
                    "page_bytes": cfg.content.page_bytes, "simulated_layer_ms": round(forward.layer_ms, 3),
                }  # fmt: skip
                entry["tier"] = through_tier(cfg, tier, device, chunks, blocks)
                entry["copies"] = copy_rates(cfg, device, clock, chunks, blocks)
                entry["overlap"] = overlap(cfg, device, clock, forward, chunks, blocks)
                report["configs"].append(entry)
                print(json.dumps(entry), flush=True)
        finally:
            tier.stop()
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["all_bytes_equal"] = all(c["tier"]["bytes_equal"] for c in report["configs"])
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "configs"}), flush=True)
    return 0 if report["all_bytes_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
