"""A tiny end-to-end demo: a local ``kvtier server`` and a tiny vLLM multimodal model.

Run from a kvtier checkout with ``scripts/demo`` (which does the set-up first).
It builds a tiny random-weight Qwen2.5-VL (kvtier.testing.tinymodels, seconds),
starts a tier as production runs it (RAM + disk under a temporary directory, the
data port on), and a vLLM engine on the CPU with the kvtier connector and vLLM's
local prefix cache off, so every hit comes from the tier. Then:

1. text + image A: computed, and its full 256-token chunks saved to the tier;
2. the same again: loaded from the tier (hit tokens printed), same output;
3. the same text + image B: only the chunks before the image hit.

The model's weights are random, so its words are noise; the numbers are the point.
It exits 1, saying what went wrong, if a request hits other than that.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHUNK = 256


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--work-dir", type=Path, help="where the model, the tier's disk and logs go (default: temp)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        return run(args.work_dir or Path(tmp))


def run(work: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
    model = _tiny_model(work / "qwen2_5_vl-tiny")
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the engine in this process: starts in seconds
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CACHE_ROOT=str(work / "vllm-cache"),
        VLLM_LOGGING_LEVEL="ERROR",
        TOKENIZERS_PARALLELISM="false",
    )
    port, data_port, metrics_port = _free_ports(3)
    log = (work / "tier.log").open("w")
    tier = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cacheserver", "--host", "127.0.0.1",
         "--port", str(port), "--data-port", str(data_port), "--metrics-port", str(metrics_port),
         "--ram-bytes", "256MiB", "--disk-dir", str(work / "tier-disk"), "--disk-bytes", "1GiB"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        target = f"127.0.0.1:{port}"
        _wait_for_tier(target, tier)
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        print(f"[demo] kvtier server on {target}, data port {data_port} (metrics: {metrics})")
        problems = _engine_demo(model, target)
        calls = _data_port_calls(metrics)
        print(f"[demo] the tier answered {calls['DataGet']} Get and {calls['DataPut']} Put calls on its data port")
        if not (calls["DataGet"] and calls["DataPut"]):
            problems.append("the engine did not use the tier's data port")
    finally:
        tier.terminate()
        tier.wait(30)
        log.close()
    for problem in problems:
        print(f"[demo] FAILED: {problem}", file=sys.stderr)
    if not problems:
        print("[demo] OK: repeats load from the tier, another image misses from the image on")
    return 1 if problems else 0


def _engine_demo(model: Path, target: str) -> list[str]:
    """Runs the three requests; what went other than the module docstring says."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    print("[demo] starting vLLM (CPU, tiny random-weight Qwen2.5-VL) with KvtierConnector ...")
    llm = LLM(
        model=str(model),
        max_model_len=4096,
        enforce_eager=True,
        enable_prefix_caching=False,  # every hit below comes from the tier
        limit_mm_per_prompt={"image": 1, "video": 0},
        dtype="bfloat16",
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector",
            kv_connector_module_path="kvtier.connector.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"target": target, "chunk_size": CHUNK},
        ),
    )
    params = SamplingParams(max_tokens=12, temperature=0.0)
    from kvtier.testing.tinymodels import prompt_text

    text = (
        "<|im_start|>user\n"
        + prompt_text(150, seed=1)
        + "<|vision_start|><|image_pad|><|vision_end|>"
        + prompt_text(250, seed=2)
        + "<|im_end|>\n<|im_start|>assistant\n"
    )

    image_pad = llm.get_tokenizer().convert_tokens_to_ids("<|image_pad|>")

    def ask(label: str, image_seed: int) -> tuple[list[int], int, int, int]:
        started = time.perf_counter()
        (out,) = llm.generate(
            [{"prompt": text, "multi_modal_data": {"image": _image(image_seed)}}],
            params,
            use_tqdm=False,
        )
        elapsed = time.perf_counter() - started
        get_kv_transfer_group().worker.sender.flush(10.0)  # let the background saves land
        print(
            f"[demo] {label}: {len(out.prompt_token_ids or ())} prompt tokens, "
            f"hit tokens from the tier: {out.num_cached_tokens}, {elapsed:.2f}s, "
            f"output ids {list(out.outputs[0].token_ids)[:6]}..."
        )
        ids = list(out.prompt_token_ids or ())
        return list(out.outputs[0].token_ids), out.num_cached_tokens, len(ids), ids.index(image_pad)

    first, hits1, length, image_at = ask("request 1 (text + image A)     ", 1)
    second, hits2, _, _ = ask("request 2 (same text + image A)", 1)
    _, hits3, _, _ = ask("request 3 (same text + image B)", 2)
    whole, before_image = length // CHUNK * CHUNK, image_at // CHUNK * CHUNK
    print(f"[demo] request 2 output identical to request 1: {first == second}")
    print(
        f"[demo] request 3 hits only the {before_image} tokens of the chunks before the image "
        f"(it starts at token {image_at}): the image is part of the keys"
    )
    problems = []
    if first != second:
        problems.append("request 2's output differs from request 1's")
    for n, (hits, want) in enumerate(((hits1, 0), (hits2, whole), (hits3, before_image)), 1):
        if hits != want:
            problems.append(f"request {n} hit {hits} tokens from the tier, not {want}")
    return problems


def _tiny_model(path: Path) -> Path:
    from kvtier.testing.tinymodels import build_vl_model

    print(f"[demo] building a tiny random-weight Qwen2.5-VL in {path}")
    return Path(build_vl_model(path))


def _image(seed: int) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free 127.0.0.1 ports (held open together while chosen)."""
    import socket

    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _data_port_calls(metrics_url: str) -> dict[str, int]:
    """The tier's answered data-port Get and Put calls, from its /metrics."""
    import re
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    calls = {"DataGet": 0, "DataPut": 0}
    for op in calls:
        for match in re.finditer(rf'^kvtier_server_requests_total{{[^}}]*op="{op}"[^}}]*}} (\S+)$', text, re.M):
            calls[op] += int(float(match.group(1)))
    return calls


def _wait_for_tier(target: str, proc: subprocess.Popen[bytes]) -> None:
    from kvtier.connector.client import TierClient
    from kvtier.connector.errors import TierError

    deadline = time.monotonic() + 30
    with TierClient(target) as client:
        while True:
            try:
                client.stats(timeout_s=1)
                return
            except TierError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("kvtier server did not start") from None
                time.sleep(0.2)


if __name__ == "__main__":
    raise SystemExit(main())
