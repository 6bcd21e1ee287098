"""``kvtier bench hybrid``: a hybrid-attention model's KV memory with vLLM's hybrid KV cache
manager on and off, both with the kvtier connector configured, from vLLM's own figures.

The model is the test suite's tiny Gemma 3 (random weights) with Gemma 3's proportions:
``--sliding`` sliding-window layers (window ``--window``, 1,024 tokens as Gemma 3's) per
full-attention layer, ``--units`` times. Two engines run it one after the other, each
with a fresh tier process: the manager on (vLLM's choice with kvtier, which supports it)
and off (``disable_hybrid_kv_cache_manager``, what vLLM did before kvtier supported
it). For each it reports:

- vLLM's own start-up line: the KV cache's capacity in tokens and its maximum
  concurrency for ``--max-model-len`` tokens per request;
- the blocks vLLM's KV cache manager holds for one prompt of ``--prompt-tokens``
  tokens, per KV cache group, at the request's last step and at its peak, in bytes
  (blocks x page size x layers of the group);
- what a hit of that prompt loads from the tier (the prompt again, from the tier).

Sizes are the tiny model's (128-dim hidden, one 64-dim KV head): the ratios, not the
bytes, carry over to a real checkpoint with the same layer pattern and window.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.testing.engine import EngineProcess
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import build_gemma3_model, prompt_text

RELAXED = {"lookup_timeout_s": 10.0, "load_timeout_s": 60.0, "save_timeout_s": 60.0}
CAPACITY = re.compile(
    r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: "
    r"([\d.]+)x"
)
TURN = ("<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n")


@dataclass
class Run:
    manager: str
    groups: str
    capacity_tokens: int
    max_concurrency: float
    prompt_tokens: int
    blocks_last: list[int]
    blocks_peak: list[int]
    kv_bytes_last: int
    kv_bytes_peak: int
    hit_tokens: int
    hit_loaded_bytes: int


def run_engine(name: str, model: Path, work: Path, args: argparse.Namespace) -> Run:
    llm_kwargs = {"max_model_len": args.max_model_len, "disable_hybrid_kv_cache_manager": name == "off"}
    tier = TierProcess.start(work / f"{name}-tier")
    engine: EngineProcess | None = None
    try:
        engine = EngineProcess.start(
            model,
            work / name,
            name=name,
            extra_config={"target": tier.target, "chunk_size": args.chunk_size, **RELAXED},
            multimodal=True,
            limit_mm_per_prompt={"image": 1},
            llm_kwargs=llm_kwargs,
            start_timeout_s=args.start_timeout_s,
            call_timeout_s=args.call_timeout_s,
        )
        groups = engine.kv_cache_groups()
        capacity = CAPACITY.search(engine.log.read_text(errors="replace"))
        assert capacity is not None, "vLLM did not log its KV cache capacity"
        ids = prompt_ids(engine, args.prompt_tokens)
        held = engine.kv_blocks({"prompt_token_ids": ids}, max_tokens=4)
        engine.flush()
        before = engine.stats()
        (hit,) = engine.generate([{"prompt_token_ids": ids}], max_tokens=2)
        after = engine.stats()
    finally:
        if engine is not None:
            engine.close()
        tier.stop()
    sizes = held["block_bytes"]
    kinds = [f"{g['spec'].removesuffix('Spec')} x{g['layers']}" for g in groups["groups"]]
    return Run(
        manager=name,
        groups=", ".join(kinds),
        capacity_tokens=int(capacity.group(1).replace(",", "")),
        max_concurrency=float(capacity.group(3)),
        prompt_tokens=len(ids),
        blocks_last=held["last"],
        blocks_peak=held["peak"],
        kv_bytes_last=sum(b * s for b, s in zip(held["last"], sizes, strict=True)),
        kv_bytes_peak=sum(b * s for b, s in zip(held["peak"], sizes, strict=True)),
        hit_tokens=hit.num_cached_tokens,
        hit_loaded_bytes=int(after.get("loaded_bytes", 0) - before.get("loaded_bytes", 0)),
    )


def prompt_ids(engine: EngineProcess, tokens: int) -> list[int]:
    """A chat prompt of exactly ``tokens`` token ids."""
    ids = engine.tokenize(TURN[0] + prompt_text(tokens, seed=7))
    tail = engine.tokenize(TURN[1])
    return ids[: tokens - len(tail)] + tail


def table(runs: list[Run]) -> str:
    lines = [
        "| hybrid manager | KV cache groups | vLLM: KV cache (tokens) | vLLM: max concurrency "
        "| blocks held (last step) | KV held per request (last / peak, MiB) "
        "| hit: tokens / loaded (MiB) |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r.manager} | {r.groups} | {r.capacity_tokens:,} | {r.max_concurrency:.2f}x "
            f"| {'+'.join(map(str, r.blocks_last))} "
            f"| {r.kv_bytes_last / 2**20:.2f} / {r.kv_bytes_peak / 2**20:.2f} "
            f"| {r.hit_tokens:,} / {r.hit_loaded_bytes / 2**20:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench hybrid", description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=1024, help="sliding window (tokens)")
    parser.add_argument("--sliding", type=int, default=5, help="sliding-window layers per full one")
    parser.add_argument("--units", type=int, default=1, help="repeats of the layer pattern")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--start-timeout-s", type=float, default=900.0)
    parser.add_argument("--call-timeout-s", type=float, default=1800.0)
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="kvtier-bench-hybrid-"))
    work.mkdir(parents=True, exist_ok=True)
    layers = (("sliding_attention",) * args.sliding + ("full_attention",)) * args.units
    model = build_gemma3_model(
        work / "models" / f"gemma3-{args.sliding}to1x{args.units}-window{args.window}"
        f"-positions{args.max_model_len}",
        sliding_window=args.window,
        layer_types=layers,
        max_position_embeddings=args.max_model_len,
    )
    runs = [run_engine(name, model, work, args) for name in ("on", "off")]
    on, off = runs
    print(table(runs))
    print(
        f"\ntiny Gemma 3, {len(layers)} layers ({args.sliding}:1 sliding-window:full, window "
        f"{args.window}), max_model_len {args.max_model_len}, prompt {on.prompt_tokens} tokens, "
        f"chunk {args.chunk_size}: KV held per request on/off {on.kv_bytes_last / off.kv_bytes_last:.2f}, "
        f"max concurrency on/off {on.max_concurrency / off.max_concurrency:.2f}, "
        f"bytes a hit loads on/off {on.hit_loaded_bytes / max(off.hit_loaded_bytes, 1):.2f}"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"runs": [asdict(r) for r in runs], "args": vars(args)}, default=str, indent=2)
        )
    return 0
