"""``kvtier bench ec``: the encoder-output cache on an image-heavy workload.

The workload: ``--requests`` chat requests, each with ``--images`` images drawn
(round robin) from a pool of ``--pool`` distinct pictures, so every picture comes
back in several requests. Three fresh engine processes run it, one after the other
(never two vLLM engines at once on a small machine), each with an empty encoder
cache of its own:

    writer    encoder cache on: encodes every picture once and saves it to the tier
    baseline  encoder cache off: a new engine encodes every picture it has not seen
    cached    encoder cache on, another process: loads every picture's encoder output

Requests go one at a time with ``max_tokens=1``, so a request's latency is its time to
first token (TTFT: pre-processing, encoder, prefill, one token). Encoder time is
measured inside the engine (forward hooks on the vision tower). The baseline and
cached engines must produce the same first tokens.

The default model is Qwen2.5-VL shaped with random weights: a ViT of ``--vision-depth``
blocks of width ``--vision-hidden`` in front of a tiny 2-layer language model, so the
encoder's share of a request is what a real VLM with many images sees. ``--tiny`` uses
the test suite's tiny model and a few requests (a CI smoke run: no speed claims).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier.testing.engine import EngineProcess
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import build_vl_model, prompt_text

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# Generous deadlines: the benchmark measures hits, not timeouts, on a busy machine.
RELAXED = {"lookup_timeout_s": 10.0, "load_timeout_s": 20.0, "save_timeout_s": 20.0}


@dataclass
class Run:
    engine: str
    encoder_cache: bool
    requests: int
    images: int
    ttft_median_s: float
    ttft_p90_s: float
    ttft_total_s: float
    encoder_calls: int
    encoder_s: float
    ec_hits: float
    ec_loaded_mb: float


def build_model(root: Path, *, depth: int, hidden: int, heads: int) -> Path:
    """The tiny test model with a bigger vision tower (random weights, cached in ``root``)."""
    base = build_vl_model(root / "qwen2_5_vl-tiny")
    out = root / f"qwen2_5_vl-vit{depth}x{hidden}"
    if (out / ".complete").exists():
        return out
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig.from_pretrained(str(base))
    vision = config.vision_config
    vision.depth = depth
    vision.hidden_size = hidden
    vision.intermediate_size = 4 * hidden
    vision.num_heads = heads
    vision.fullatt_block_indexes = [i for i in range(depth) if i % 4 == 3] or [depth - 1]
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for path in base.iterdir():
        if path.is_file() and not (out / path.name).exists() and path.name != ".complete":
            shutil.copy(path, out / path.name)
    (out / ".complete").touch()
    return out


def workload(requests: int, images: int, pool: int, size: int) -> list[dict[str, Any]]:
    prompts = []
    for r in range(requests):
        seeds = [(r * images + i) % pool for i in range(images)]
        text = "<|im_start|>user\n" + IMAGE * images + prompt_text(20, seed=r)
        prompts.append(
            {
                "prompt": text + "<|im_end|>\n<|im_start|>assistant\n",
                "images": [{"seed": 1000 + s, "size": [size, size]} for s in seeds],
            }
        )
    return prompts


def run_engine(
    name: str,
    model: Path,
    work: Path,
    prompts: list[dict[str, Any]],
    ec_config: dict[str, Any] | None,
    images: int,
) -> tuple[Run, list[list[int]]]:
    engine = EngineProcess.start(
        model,
        work / name,
        name=name,
        ec_extra_config=ec_config,
        multimodal=True,
        limit_mm_per_prompt={"image": images, "video": 0},
    )
    try:
        latencies, tokens = [], []
        for prompt in prompts:
            started = time.perf_counter()
            (out,) = engine.generate([prompt], max_tokens=1)
            latencies.append(time.perf_counter() - started)
            tokens.append(out.token_ids)
        if ec_config is not None:
            engine.ec_flush()
        stats = engine.ec_stats()
        run = Run(
            engine=name,
            encoder_cache=ec_config is not None,
            requests=len(prompts),
            images=sum(len(p["images"]) for p in prompts),
            ttft_median_s=statistics.median(latencies),
            ttft_p90_s=_quantile(latencies, 0.9),
            ttft_total_s=sum(latencies),
            encoder_calls=engine.encoder_calls(),
            encoder_s=engine.encoder_seconds(),
            ec_hits=stats.get("hits", 0),
            ec_loaded_mb=stats.get("loaded_bytes", 0) / 1e6,
        )
    finally:
        engine.close()
    return run, tokens


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(runs: list[Run]) -> str:
    lines = [
        "| engine | encoder cache | requests | images | TTFT median (s) | TTFT p90 (s) "
        "| TTFT total (s) | encoder calls | encoder time (s) | EC hits | loaded (MB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r.engine} | {'on' if r.encoder_cache else 'off'} | {r.requests} | {r.images} "
            f"| {r.ttft_median_s:.3f} | {r.ttft_p90_s:.3f} | {r.ttft_total_s:.2f} "
            f"| {r.encoder_calls} | {r.encoder_s:.2f} | {r.ec_hits:.0f} | {r.ec_loaded_mb:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench ec", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--images", type=int, default=4, help="images per request")
    parser.add_argument("--pool", type=int, default=8, help="distinct pictures")
    parser.add_argument("--size", type=int, default=448, help="image side in pixels")
    parser.add_argument("--vision-depth", type=int, default=16)
    parser.add_argument("--vision-hidden", type=int, default=512)
    parser.add_argument("--vision-heads", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="CI smoke run: tiny model, 3 requests")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.requests, args.images, args.pool, args.size = 3, 2, 3, 224
    work = args.work or Path(tempfile.mkdtemp(prefix="kvtier-bench-ec-"))
    work.mkdir(parents=True, exist_ok=True)
    models = work / "models"
    model = (
        build_vl_model(models / "qwen2_5_vl-tiny")
        if args.tiny
        else build_model(
            models, depth=args.vision_depth, hidden=args.vision_hidden, heads=args.vision_heads
        )
    )
    prompts = workload(args.requests, args.images, args.pool, args.size)
    tier = TierProcess.start(work / "tier")
    try:
        config = {"target": tier.target, **RELAXED}
        writer, _ = run_engine("writer", model, work, prompts, config, args.images)
        baseline, expected = run_engine("baseline", model, work, prompts, None, args.images)
        cached, tokens = run_engine("cached", model, work, prompts, config, args.images)
    finally:
        tier.stop()
    runs = [writer, baseline, cached]
    same = tokens == expected
    print(table(runs))
    print(
        f"\nmodel {model.name}, {args.requests} requests x {args.images} images of "
        f"{args.size}px from {args.pool} pictures; cached vs baseline: TTFT total "
        f"{baseline.ttft_total_s / max(cached.ttft_total_s, 1e-9):.2f}x, encoder time "
        f"{baseline.encoder_s:.2f}s -> {cached.encoder_s:.2f}s; same first tokens: {same}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"runs": [asdict(r) for r in runs], "same_tokens": same, "args": vars(args)},
                default=str,
                indent=2,
            )
        )
    return 0 if same else 1
