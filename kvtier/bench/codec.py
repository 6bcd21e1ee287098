"""``kvtier bench codec``: what the ``zstd`` chunk codec saves and costs, per zstd level.

Data sets:

    engine   the KV chunks a real vLLM engine (CPU backend, bf16) saved to a
             ``kvtier server``: a random-weight Qwen2 (by default the Qwen2-0.5B shape
             of ``kvtier bench e2e``: ``--layers`` ... ; ``--tiny``: the test suite's
             2-layer model) runs ``--prompts`` text prompts of ``--prompt-words`` words;
             every full chunk is read back from the tier and decoded to its raw
             payload, the bytes ``codec: zstd`` compresses.
    random   normal(0, 1) values rounded to bf16, in pieces of the engine's chunk
             payload size (or 128 KiB without an engine) and of 4 MiB.

Each piece is compressed on its own, as the connector's sender does
(``zstandard.ZstdCompressor(level).compress``), and decompressed as a load does
(``ZstdDecompressor().decompress(..., max_output_size=...)``); every round trip is
checked byte for byte. Per data set and level: the ratio (raw bytes / compressed
bytes over the set) and compress and decompress MB/s (10^6 raw bytes per second,
one thread, the median of ``--repeat`` passes over the set). Times are this thread's
CPU time (``--clock cpu``, the default; other processes taking the core are left out)
or elapsed time (``--clock wall``).

``--no-engine`` measures the random sets only (no vLLM); with ``--quick`` that is
the CI run of tests/bench/test_codec_bench.py. docs/connector.md ("The zstd codec")
has the results and the command that made them.
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

CHUNK_TOKENS = 256
FOUR_MIB = 4 << 20


@dataclass(frozen=True)
class DataSet:
    name: str
    pieces: list[bytes]


@dataclass(frozen=True)
class Row:
    data: str
    pieces: int
    piece_bytes: int
    level: int
    ratio: float
    compress_mb_s: float
    decompress_mb_s: float


def random_bf16(nbytes: int, seed: int) -> bytes:
    """``nbytes`` of normal(0, 1) values rounded to bf16 (round to nearest even)."""
    values = np.random.default_rng(seed).standard_normal(nbytes // 2, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16).tobytes()


def random_sets(piece_bytes: int, total_bytes: int) -> list[DataSet]:
    sets = []
    for size in dict.fromkeys([piece_bytes, FOUR_MIB]):
        count = max(1, total_bytes // size)
        pieces = [random_bf16(size, seed) for seed in range(count)]
        sets.append(DataSet(f"random bf16, {_size(size)}", pieces))
    return sets


def engine_set(args: argparse.Namespace, work: Path) -> DataSet:
    """The raw payloads of every full chunk a real engine saved (module doc)."""
    from kvtier.bench.e2e import build_text_model
    from kvtier.connector.chunks.codec import decode_chunk
    from kvtier.connector.client import TierClient
    from kvtier.testing.engine import EngineProcess
    from kvtier.testing.tierproc import TierProcess
    from kvtier.testing.tinymodels import prompt_text

    model = build_text_model(work / "models", args)
    tier = TierProcess.start(work / "tier", "--ram-bytes", "2GiB")
    engine = None
    try:
        config = {"target": tier.target, "chunk_size": CHUNK_TOKENS, "save_timeout_s": 60.0}
        llm = {"max_model_len": 8192, "enforce_eager": True, "enable_prefix_caching": False,
               "seed": 0, "dtype": "bfloat16"}  # fmt: skip
        engine = EngineProcess.start(model, work / "engine", extra_config=config, llm_kwargs=llm,
                                     start_timeout_s=600.0, call_timeout_s=600.0)  # fmt: skip
        keys: list[bytes] = []
        for seed in range(args.prompts):
            prompt = prompt_text(args.prompt_words, seed=1000 + seed)
            engine.generate([{"prompt": prompt}], max_tokens=1)
            keys += engine.chunk_keys(prompt)
        engine.flush()
        with TierClient(tier.target) as client:
            blobs = client.get(keys)
        pieces, shape, dtype = [], (), ""
        for key, blob in zip(keys, blobs, strict=True):
            if blob is None:
                raise SystemExit("kvtier bench codec: a chunk the engine saved is not in the tier")
            chunk = decode_chunk(key, blob)
            pieces.append(bytes(chunk.payload))
            shape, dtype = chunk.shape, chunk.dtype
        if not pieces:
            raise SystemExit("kvtier bench codec: the prompts filled no chunk (--prompt-words)")
        dims = ", ".join(str(d) for d in shape)
        name = f"{model.name} KV chunks ([{dims}] {dtype}, {_size(len(pieces[0]))}, vLLM CPU)"
        return DataSet(name, pieces)
    finally:
        if engine is not None:
            engine.close()
        tier.stop()


def measure(data: DataSet, level: int, repeat: int, clock: Callable[[], float]) -> Row:
    import zstandard

    compressor = zstandard.ZstdCompressor(level=level)
    decompressor = zstandard.ZstdDecompressor()
    raw = sum(len(p) for p in data.pieces)
    packed = [compressor.compress(p) for p in data.pieces]
    for piece, frame in zip(data.pieces, packed, strict=True):
        if decompressor.decompress(frame, max_output_size=len(piece)) != piece:
            raise SystemExit(f"kvtier bench codec: zstd level {level} did not round-trip")
    compress_s, decompress_s = [], []
    for _ in range(repeat):
        start = clock()
        for piece in data.pieces:
            compressor.compress(piece)
        compress_s.append(clock() - start)
        start = clock()
        for piece, frame in zip(data.pieces, packed, strict=True):
            decompressor.decompress(frame, max_output_size=len(piece))
        decompress_s.append(clock() - start)
    return Row(
        data=data.name,
        pieces=len(data.pieces),
        piece_bytes=len(data.pieces[0]),
        level=level,
        ratio=raw / sum(len(f) for f in packed),
        compress_mb_s=raw / statistics.median(compress_s) / 1e6,
        decompress_mb_s=raw / statistics.median(decompress_s) / 1e6,
    )


def markdown(rows: list[Row]) -> str:
    lines = [
        "| data | pieces | level | ratio | compress MB/s | decompress MB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.data} | {r.pieces} | {r.level} | {r.ratio:.2f} | "
                     f"{r.compress_mb_s:.0f} | {r.decompress_mb_s:.0f} |")  # fmt: skip
    return "\n".join(lines)


def machine(load_start: tuple[float, ...]) -> dict[str, Any]:
    from importlib.metadata import version

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "zstandard": version("zstandard"), "load_avg_start": load_start,
            "load_avg_end": os.getloadavg()}  # fmt: skip


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n >> 10} KiB"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench codec", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--levels", default="1,3", help="comma-separated zstd levels")
    p.add_argument("--repeat", type=int, default=7, help="timed passes per data set and level")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--random-mib", type=int, default=16, help="MiB of each random data set")
    p.add_argument("--no-engine", action="store_true", help="random data only: no vLLM")
    p.add_argument("--prompts", type=int, default=3, help="text prompts the engine saves")
    p.add_argument("--prompt-words", type=int, default=700, help="words per prompt (~2.9 tokens each)")
    p.add_argument("--layers", type=int, default=24, help="text model layers")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--tiny", action="store_true", help="the test suite's 2-layer text model")
    p.add_argument("--quick", action="store_true", help="CI: 1 MiB random sets, 1 pass")
    p.add_argument("--work", type=Path, help="scratch directory (the model is cached here)")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    if args.quick:
        args.random_mib, args.repeat = 4, 1
    try:
        levels = [int(x) for x in args.levels.split(",")]
    except ValueError:
        raise SystemExit(f"--levels: {args.levels!r} is not comma-separated integers") from None
    if args.repeat < 1:
        raise SystemExit("--repeat: at least 1")
    load_start = os.getloadavg()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    sets: list[DataSet] = []
    piece_bytes = 128 << 10
    if not args.no_engine:
        work = args.work or Path(tempfile.mkdtemp(prefix="kvtier-bench-codec-"))
        engine = engine_set(args, work)
        sets.append(engine)
        piece_bytes = len(engine.pieces[0])
    sets += random_sets(piece_bytes, args.random_mib << 20)
    rows = [measure(data, level, args.repeat, clock) for data in sets for level in levels]
    text = markdown(rows)
    info = machine(load_start)
    print(text)
    print(f"\n{args.clock} time, median of {args.repeat}; {info}")
    if args.json:
        args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "machine": info,
                                         "clock": args.clock, "repeat": args.repeat}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
