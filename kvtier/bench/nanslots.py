"""What vLLM's CPU attention reads besides the tokens it attends to (issue 21, defect 1).

    python -m kvtier.bench.nanslots [--dir DIR]

A wrong output of the form ``[x, 0, 0, ...]`` (a right first token, then token 0 over
and over) is what NaN logits look like. This probe runs the tiny Gemma 3 of the recipe
tests (one sliding-window layer, window 128, one full-attention layer; vLLM's hybrid
KV cache manager on) in this process, without a connector and with prefix caching
off, and generates a 660-token prompt three ways: on a clean KV cache; with the null
block (block 0, what a group's block table holds where it keeps no block) filled with
NaN; and with every block filled with NaN before the request writes its own tokens.
Prints the generated tokens of each.

Measured on vLLM 0.32.0 (CPU): the null block is never read (same output as clean),
but NaN in blocks before a request writes its tokens into them turns every output token
into 0, the first one included. Every slot of a prompt is written before it is read, so
what the kernel reads besides the tokens it attends to must be the slots it has not
written (past the last token of the last block; the likely reading: a tile's masked
slots still go through the P x V product with a probability of 0, and 0 x NaN is NaN).
A block's unwritten slots hold what its previous user left there. So the defect's output
(right first token, then 0s) fits bytes that are not KV (an encoded chunk, a header)
left in a free block that a request then decodes into, or written into the request's
last block after the step that computed its first token.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.nanslots", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="where the tiny model is built (default: a temp dir)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the KV cache in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams

    from kvtier.testing.tinymodels import prompt_text
    from kvtier.testing.tinymodels.build import build_gemma3_model

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        model = build_gemma3_model(Path(tmp) / "gemma3")
        llm = LLM(model=str(model), max_model_len=4096, enforce_eager=True, enable_prefix_caching=False,
                  limit_mm_per_prompt={"image": 0}, seed=0)  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=12)
        core = llm.llm_engine.engine_core.engine_core
        caches = core.model_executor.driver_worker.worker.model_runner.kv_caches
        groups = [(type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None))
                  for g in core.scheduler.kv_cache_config.kv_cache_groups]  # fmt: skip

        def generate() -> list[int]:
            out = llm.generate([prompt_text(330, seed=1)], params, use_tqdm=False)[0]
            return list(out.outputs[0].token_ids)

        print(f"KV cache groups: {groups}")
        print(f"clean KV cache:                   {generate()}")
        for cache in caches:
            cache[0].fill_(float("nan"))
        print(f"null block (block 0) NaN:         {generate()}")
        for cache in caches:
            cache[1:].fill_(float("nan"))
        print(f"every block NaN before the run:   {generate()}")


if __name__ == "__main__":
    main()
