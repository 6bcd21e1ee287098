"""``kvtier bench e2e``: time to first token on real vLLM (CPU), with and without a KV tier.

Workloads (requests go one at a time, ``max_tokens=1``, so a request's latency is
its time to first token, TTFT; the sum over a workload is its total prefill time):

    docqa  ``--docs`` documents of ``--doc-tokens`` tokens, each asked about twice
           (two different questions), in a seeded random order; a document's
           second ask is a "repeat" request, its first a "first" request.
    chat   ``--users`` users sharing a ``--system-tokens`` system prompt, each
           ``--rounds`` rounds whose history grows by a user message and an
           assistant reply per round, users interleaved; round 0 is "first"
           (only the system prompt is shared), later rounds are "repeat".
    mm     the docqa shape with images: ``--mm-docs`` documents of ``--images``
           pictures and some text, each asked about twice (Qwen2.5-VL-shaped).

Arms, each its own fresh engine process, run one after the other (never two
engines at once on a small machine):

    no-cache            vLLM alone
    vllm-prefix-cache   vLLM's in-engine prefix cache, no external cache (a reference:
                        what reuse costs when the KV never leaves the engine; not in
                        the default set)
    vllm-offload        vLLM's own CPU offloading (``kv_offloading_size``, the
                        native backend: OffloadingConnector)
    vllm-simple-offload the same with VLLM_USE_SIMPLE_KV_OFFLOAD=1
                        (SimpleCPUOffloadConnector)
    kvtier              the kvtier connector and a ``kvtier server`` (RAM + disk)
                        on this machine, chunks over its data port
    kvtier-local        the same tier over the same-node transport (``local_socket``:
                        a Unix socket, chunks through the tier's shared memory)

Fairness: no-cache and kvtier run with vLLM's in-engine prefix cache OFF
(``enable_prefix_caching=False``), so nothing is reused inside the engine and a
repeat request is served only by the external cache under test. vLLM's offloading
connectors require the prefix cache, so their arms run with it on (and would get
in-engine hits too). An arm whose
engine does not start is reported with the engine's exact error.

The text model is a Qwen2 with random weights built here (``--layers``, ``--hidden``
...; the default is the 0.5B Qwen2 shape with fewer layers, see --help), with the
test suite's locally trained tokenizer (vocabulary 2048: the LM head runs on one
token per request, so the vocabulary size barely touches prefill). The mm model is
Qwen2.5-VL-shaped: the same language-model shape behind a bigger vision tower
(``--vision-depth``, ``--vision-hidden``), or the test suite's tiny one with ``--tiny``.
The mm arms keep vLLM's multimodal processor cache on (its default): vLLM then names
each image by its content, which kvtier's keys need (with that cache and the prefix
cache both off, vLLM names images per request and the connector refuses to start).
So in every arm vLLM's own encoder cache serves an image the engine has already
encoded; what a no-cache repeat still pays is the prompt's prefill.

``--tiny`` is the CI smoke run (tiny models, short prompts, a few requests): it
proves the harness works and makes no speed claim.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.testing.engine import EngineError, EngineProcess
from kvtier.testing.tierproc import TierProcess

# An engine of a big model may take long to start, and a long prompt to prefill on a CPU.
START_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 900.0
ARMS = ("no-cache", "vllm-offload", "vllm-simple-offload", "kvtier", "kvtier-local", "vllm-prefix-cache")
DEFAULT_ARMS = ("no-cache", "vllm-offload", "vllm-simple-offload", "kvtier", "kvtier-local")
KVTIER_ARMS = ("kvtier", "kvtier-local")
WORKLOADS = ("docqa", "chat", "mm")
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# The benchmark measures hits, not deadlines: generous ones on a busy machine.
RELAXED = {"lookup_timeout_s": 30.0, "load_timeout_s": 120.0, "save_timeout_s": 120.0,
           "save_queue_chunks": 4096}  # fmt: skip


@dataclass
class Request:
    workload: str
    kind: str  # "first" or "repeat"
    label: str
    prompt: dict[str, Any]


@dataclass
class Result:
    arm: str
    workload: str
    kind: str
    label: str
    ttft_s: float
    save_wait_s: float
    token: int
    cached_tokens: int
    prompt_tokens: int


@dataclass
class ArmRun:
    arm: str
    model: str
    error: str = ""
    start_s: float = 0.0
    connector: dict[str, float] = field(default_factory=dict)


# -- models --------------------------------------------------------------------------


def build_text_model(root: Path, args: argparse.Namespace) -> Path:
    """A random-weight Qwen2ForCausalLM of the requested shape (cached in ``root``)."""
    from kvtier.testing.tinymodels import build_text_model as build_tiny

    tiny = build_tiny(root / "qwen2-tiny")
    if args.tiny:
        return tiny
    name = (
        f"qwen2-h{args.hidden}-l{args.layers}-a{args.heads}-kv{args.kv_heads}-i{args.intermediate}"
    )
    out = root / name
    if (out / ".complete").exists():
        return out
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base = Qwen2Config.from_pretrained(str(tiny))
    config = Qwen2Config(
        vocab_size=base.vocab_size,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=32768,
        initializer_range=0.02,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    config.dtype = torch.bfloat16
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    _copy_tokenizer(tiny, out)
    (out / ".complete").touch()
    return out


def build_mm_model(root: Path, args: argparse.Namespace) -> Path:
    """A random-weight Qwen2.5-VL: the text model's language-model shape (``--layers``,
    ``--hidden`` ...) behind a ``--vision-depth`` x ``--vision-hidden`` ViT (cached in
    ``root``); the test suite's tiny one with ``--tiny``."""
    from kvtier.testing.tinymodels import build_vl_model

    if args.tiny:
        return build_vl_model(root / "qwen2_5_vl-tiny")
    base = build_vl_model(root / "qwen2_5_vl-tiny")
    out = root / (
        f"qwen2_5_vl-vit{args.vision_depth}x{args.vision_hidden}-h{args.hidden}-l{args.layers}"
        f"-a{args.heads}-kv{args.kv_heads}-i{args.intermediate}"
    )
    if (out / ".complete").exists():
        return out
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig.from_pretrained(str(base))
    vision = config.vision_config
    vision.depth, vision.hidden_size = args.vision_depth, args.vision_hidden
    vision.intermediate_size, vision.num_heads = 4 * args.vision_hidden, 8
    vision.fullatt_block_indexes = [i for i in range(vision.depth) if i % 4 == 3] or [
        vision.depth - 1
    ]
    text = config.text_config
    text.hidden_size, text.num_hidden_layers = args.hidden, args.layers
    text.num_attention_heads, text.num_key_value_heads = args.heads, args.kv_heads
    text.intermediate_size, text.initializer_range = args.intermediate, 0.02
    text.layer_types = ["full_attention"] * args.layers
    half = args.hidden // args.heads // 2  # M-RoPE sections split half the head size
    text.rope_parameters["mrope_section"] = [half // 4, (half - half // 4) // 2,
                                             half - half // 4 - (half - half // 4) // 2]  # fmt: skip
    vision.out_hidden_size = args.hidden
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    _copy_tokenizer(base, out)
    (out / ".complete").touch()
    return out


def _copy_tokenizer(src: Path, out: Path) -> None:
    for path in src.iterdir():
        skip = (".complete", "config.json", "generation_config.json")
        if path.is_file() and path.suffix != ".safetensors" and path.name not in skip:
            shutil.copy(path, out / path.name)
    # The tokenizer's own limit is 8192; documents here may be longer.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_max_length"] = 65536
    cfg_path.write_text(json.dumps(cfg, indent=2))


# -- workloads -----------------------------------------------------------------------


class Tokens:
    """Exact-length token sequences from the model's tokenizer."""

    def __init__(self, model: Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model))

    def ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def text_ids(self, n: int, seed: int) -> list[int]:
        from kvtier.testing.tinymodels import prompt_text

        ids: list[int] = []
        words = max(8, n // 2)
        while len(ids) < n:
            ids = self.ids(prompt_text(words, seed=seed))
            words *= 2
        return ids[:n]


def docqa(tokens: Tokens, args: argparse.Namespace, rng: random.Random) -> list[Request]:
    head = tokens.ids("<|im_start|>user\nRead the document below, then answer.\n")
    tail = tokens.ids("<|im_end|>\n<|im_start|>assistant\n")
    docs = [tokens.text_ids(args.doc_tokens, seed=100 + d) for d in range(args.docs)]
    order = [d for d in range(args.docs) for _ in range(2)]
    rng.shuffle(order)
    seen: set[int] = set()
    requests = []
    for i, d in enumerate(order):
        question = tokens.ids("\nQuestion: ") + tokens.text_ids(args.question_tokens, seed=5000 + i)
        kind = "repeat" if d in seen else "first"
        seen.add(d)
        ids = head + docs[d] + question + tail
        requests.append(Request("docqa", kind, f"doc{d}", {"prompt_token_ids": ids}))
    return requests


def chat(tokens: Tokens, args: argparse.Namespace) -> list[Request]:
    system = (
        tokens.ids("<|im_start|>system\n")
        + tokens.text_ids(args.system_tokens, seed=7)
        + tokens.ids("<|im_end|>\n")
    )
    history: list[list[int]] = [list(system) for _ in range(args.users)]
    requests = []
    for r in range(args.rounds):
        for u in range(args.users):
            seed = 10_000 + 100 * u + r
            user = (
                tokens.ids("<|im_start|>user\n")
                + tokens.text_ids(args.message_tokens, seed=seed)
                + tokens.ids("<|im_end|>\n<|im_start|>assistant\n")
            )
            ids = history[u] + user
            requests.append(
                Request("chat", "first" if r == 0 else "repeat", f"user{u}/round{r}",
                        {"prompt_token_ids": ids})
            )  # fmt: skip
            # The assistant's reply (written here: max_tokens=1 generates one token).
            history[u] = (
                ids
                + tokens.text_ids(args.reply_tokens, seed=seed + 50)
                + tokens.ids("<|im_end|>\n")
            )
    return requests


def mm(args: argparse.Namespace, rng: random.Random) -> list[Request]:
    from kvtier.testing.tinymodels import prompt_text

    order = [d for d in range(args.mm_docs) for _ in range(2)]
    rng.shuffle(order)
    seen: set[int] = set()
    requests = []
    for i, d in enumerate(order):
        images = [{"seed": 1000 + d * args.images + k, "size": [args.image_size] * 2}
                  for k in range(args.images)]  # fmt: skip
        text = (
            "<|im_start|>user\n" + IMAGE * args.images + prompt_text(args.mm_words, seed=200 + d)
            + "\nQuestion: " + prompt_text(12, seed=6000 + i)
            + "<|im_end|>\n<|im_start|>assistant\n"
        )  # fmt: skip
        kind = "repeat" if d in seen else "first"
        seen.add(d)
        requests.append(Request("mm", kind, f"doc{d}", {"prompt": text, "images": images}))
    return requests


# -- arms ----------------------------------------------------------------------------


def arm_spec(arm: str, model: Path, max_len: int, mm_images: int, tier: TierProcess, args: argparse.Namespace
             ) -> tuple[dict[str, Any], dict[str, str]]:  # fmt: skip
    llm: dict[str, Any] = {
        "model": str(model),
        "max_model_len": max_len,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "seed": 0,
        "dtype": "bfloat16",
    }
    if mm_images:
        # vLLM's processor cache stays on (its default): with it and the prefix cache
        # both off, vLLM names images per request, and kvtier refuses such an engine.
        llm["limit_mm_per_prompt"] = {"image": mm_images, "video": 0}
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    spec: dict[str, Any] = {"llm": llm, "kvtier": None}
    if arm in ("vllm-offload", "vllm-simple-offload"):
        # Both need the in-engine prefix cache (SimpleCPUOffloadConnector turns itself
        # off without it: "disabling CPU offload since it requires prefix caching").
        llm["enable_prefix_caching"] = True
        llm["kv_offloading_size"] = args.offload_gib
        llm["kv_offloading_backend"] = "native"
        env["VLLM_USE_SIMPLE_KV_OFFLOAD"] = "1" if arm == "vllm-simple-offload" else "0"
    elif arm == "vllm-prefix-cache":
        llm["enable_prefix_caching"] = True
    elif arm in KVTIER_ARMS:
        # One tier serves both kvtier arms: a salt per arm keeps one from hitting the other's chunks.
        spec["kvtier"] = {"target": tier.target, "salt": arm, **RELAXED}
        if arm == "kvtier-local":
            spec["kvtier"]["local_socket"] = tier.local_socket
    return spec, env


# -- the run -------------------------------------------------------------------------


class Progress:
    """One line on stderr, rewritten in place on a terminal; a line per step otherwise."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()

    def step(self, text: str) -> None:
        self.done += 1
        line = f"[e2e {self.done}/{self.total} {time.monotonic() - self.started:5.0f}s] {text}"
        sys.stderr.write(("\r\033[K" + line) if self.tty else line + "\n")
        sys.stderr.flush()

    def note(self, text: str) -> None:
        sys.stderr.write(("\r\033[K" if self.tty else "") + "[e2e] " + text + "\n")
        sys.stderr.flush()

    def end(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def run_arm(arm: str, spec: dict[str, Any], env: dict[str, str], requests: list[Request],
            warmup: dict[str, Any], work: Path, progress: Progress, model_name: str
            ) -> tuple[ArmRun, list[Result]]:  # fmt: skip
    run = ArmRun(arm, model_name)
    started = time.perf_counter()
    progress.note(f"{arm}: starting the engine ({model_name})")
    llm = dict(spec["llm"])
    try:
        engine = EngineProcess.start(
            Path(llm.pop("model")), work / f"{model_name}-{arm}", name=arm,
            extra_config=spec["kvtier"], llm_kwargs=llm, env=env,
            start_timeout_s=START_TIMEOUT_S, call_timeout_s=CALL_TIMEOUT_S,
        )  # fmt: skip
    except EngineError as exc:
        run.error = _first_line(str(exc))
        progress.note(f"{arm}: engine did not start: {run.error}")
        progress.done += len(requests)
        return run, []
    run.start_s = time.perf_counter() - started
    results = []
    try:
        # Not measured: the first forward pass of an engine pays one-off costs.
        engine.measure(warmup)
        for req in requests:
            progress.step(f"{arm} {req.workload} {req.kind} {req.label}")
            r = engine.measure(req.prompt)
            results.append(Result(arm, req.workload, req.kind, req.label, r.ttft_s,
                                  r.save_wait_s, r.token, r.cached_tokens,
                                  r.prompt_tokens))  # fmt: skip
        run.connector = engine.stats()
    except EngineError as exc:
        run.error = f"failed at request {len(results)}: {_first_line(str(exc))}"
        progress.note(f"{arm}: {run.error}")
        progress.done += len(requests) - len(results)
        results = []  # an arm counts whole or not at all
    finally:
        engine.close()
    return run, results


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0][:400] if lines else "(no message)"


def summarize(results: list[Result], arms: list[str]) -> list[dict[str, Any]]:
    """One row per (workload, arm): TTFT of first and repeat requests, totals, ratios."""
    rows = []
    # (workload, label, kind) names one request of a workload.
    base = {(r.workload, r.label, r.kind): r for r in results if r.arm == "no-cache"}
    for workload in WORKLOADS:
        for arm in arms:
            mine = [r for r in results if r.arm == arm and r.workload == workload]
            if not mine:
                continue
            row: dict[str, Any] = {"workload": workload, "arm": arm, "requests": len(mine)}
            for kind in ("first", "repeat"):
                ttfts = [r.ttft_s for r in mine if r.kind == kind]
                row[f"{kind}_n"] = len(ttfts)
                row[f"{kind}_ttft_mean_s"] = statistics.fmean(ttfts) if ttfts else None
                row[f"{kind}_ttft_median_s"] = statistics.median(ttfts) if ttfts else None
            row["prefill_total_s"] = sum(r.ttft_s for r in mine)
            row["save_wait_total_s"] = sum(r.save_wait_s for r in mine)
            row["prompt_tokens"] = sum(r.prompt_tokens for r in mine)
            row["cached_tokens"] = sum(r.cached_tokens for r in mine)
            same = [base.get((r.workload, r.label, r.kind)) for r in mine]
            row["same_first_token"] = sum(
                1 for r, b in zip(mine, same, strict=True) if b is not None and b.token == r.token
            )
            rows.append(row)
    by_key = {(r["workload"], r["arm"]): r for r in rows}
    for row in rows:
        ref = by_key.get((row["workload"], "no-cache"))
        for what in ("first_ttft_mean_s", "repeat_ttft_mean_s", "prefill_total_s"):
            ratio = None
            if ref and row[what] is not None and ref[what]:
                ratio = row[what] / ref[what]
            row[f"{what.removesuffix('_s').replace('_mean', '')}_vs_no_cache"] = ratio
    return rows


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    row = next((r for r in rows if r["workload"] == "docqa" and r["arm"] == "kvtier"), None)
    if row is None:
        return []
    repeat, first = row["repeat_ttft_vs_no_cache"], row["first_ttft_vs_no_cache"]
    return [
        {"goal": "docqa repeat TTFT <= 0.25x no-cache", "ratio": repeat,
         "met": repeat is not None and repeat <= 0.25},
        {"goal": "docqa first TTFT <= 1.05x no-cache", "ratio": first,
         "met": first is not None and first <= 1.05},
    ]  # fmt: skip


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(
    rows: list[dict[str, Any]], arm_runs: list[ArmRun], goal_rows: list[dict[str, Any]]
) -> str:
    lines = [
        "| workload | arm | requests | first TTFT mean (s) | repeat TTFT mean (s) "
        "| first / no-cache | repeat / no-cache | prefill total (s) | total / no-cache "
        "| cached / prompt tokens | save wait (s) | same first token |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['arm']} | {r['requests']} | {_f(r['first_ttft_mean_s'])} "
            f"| {_f(r['repeat_ttft_mean_s'])} | {_f(r['first_ttft_vs_no_cache'], 2)} "
            f"| {_f(r['repeat_ttft_vs_no_cache'], 2)} | {r['prefill_total_s']:.2f} "
            f"| {_f(r['prefill_total_vs_no_cache'], 2)} | {r['cached_tokens']} / {r['prompt_tokens']} "
            f"| {r['save_wait_total_s']:.2f} | {r['same_first_token']}/{r['requests']} |"
        )
    failed = [a for a in arm_runs if a.error]
    if failed:
        lines += ["", "Arms whose engine did not start:", ""]
        lines += [f"- {a.arm} ({a.model}): `{a.error}`" for a in failed]
    if goal_rows:
        lines += ["", "Goals (kvtier against no-cache, docqa):", ""]
        lines += [f"- {g['goal']}: {_f(g['ratio'], 2)} -> {'met' if g['met'] else 'NOT met'}"
                  for g in goal_rows]  # fmt: skip
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from importlib.metadata import version

    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "vllm": version("vllm-cpu"), "load_avg": os.getloadavg()}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    arms = [a.strip() for a in args.arms.split(",")]
    workloads = [w.strip() for w in args.workloads.split(",")]
    for a in arms:
        if a not in ARMS:
            raise SystemExit(f"--arms: unknown arm {a!r}; known: {', '.join(ARMS)}")
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"--workloads: unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    if "no-cache" not in arms:
        raise SystemExit("--arms: must include no-cache (the baseline every ratio is against)")
    work = args.work or Path(tempfile.mkdtemp(prefix="kvtier-bench-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    groups: list[tuple[Path, list[Request], int, dict[str, Any]]] = []
    if "docqa" in workloads or "chat" in workloads:
        model = build_text_model(work / "models", args)
        tokens = Tokens(model)
        reqs = (docqa(tokens, args, rng) if "docqa" in workloads else []) + (
            chat(tokens, args) if "chat" in workloads else []
        )
        warmup: dict[str, Any] = {"prompt_token_ids": tokens.text_ids(512, seed=99)}
        groups.append((model, reqs, 0, warmup))
    if "mm" in workloads:
        warmup_mm: dict[str, Any] = {
            "prompt": IMAGE + "warm up",
            "images": [{"seed": 1, "size": [224, 224]}],
        }
        groups.append(
            (build_mm_model(work / "models", args), mm(args, rng), args.images, warmup_mm)
        )
    total = sum(len(g[1]) for g in groups) * len(arms)
    progress = Progress(total)
    shutil.rmtree(work / "tier", ignore_errors=True)  # a fresh tier: its disk tier persists
    tier = TierProcess.start(
        work / "tier", "--ram-bytes", args.tier_ram, "--disk-bytes", args.tier_disk,
        data_port=True, local_socket=True,
    )  # fmt: skip
    arm_runs: list[ArmRun] = []
    results: list[Result] = []
    failed_before: dict[str, str] = {}
    try:
        for model, reqs, images, warmup in groups:
            max_len = _max_len(reqs, model, images, args)
            for arm in arms:
                if arm in failed_before:  # the same engine failure on the next model: skip it
                    arm_runs.append(ArmRun(arm, model.name, f"not run: {failed_before[arm]}"))
                    progress.done += len(reqs)
                    continue
                spec, env = arm_spec(arm, model, max_len, images, tier, args)
                arm_run, res = run_arm(arm, spec, env, reqs, warmup, work, progress, model.name)
                arm_runs.append(arm_run)
                results += res
                if arm_run.error:
                    failed_before[arm] = arm_run.error
    finally:
        progress.end()
        tier.stop()
    rows = summarize(results, arms)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {
        "config": config,
        "machine": machine(),
        "models": [g[0].name for g in groups],
        "arms": [asdict(a) for a in arm_runs],
        "results": [asdict(r) for r in results],
        "summary": rows,
        "goals": goals(rows),
        "markdown": markdown(rows, arm_runs, goals(rows)),
    }


def _max_len(reqs: list[Request], model: Path, images: int, args: argparse.Namespace) -> int:
    longest = (
        max(len(r.prompt["prompt_token_ids"]) for r in reqs if "prompt_token_ids" in r.prompt)
        if any("prompt_token_ids" in r.prompt for r in reqs)
        else 0
    )
    if images:  # text words (<= 3 tokens each) + image placeholders ((side/28)^2 each)
        longest = max(longest, 3 * (args.mm_words + 40) + images * (args.image_size // 28) ** 2)
    return 128 * (longest // 128 + 2)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench e2e", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument(
        "--arms", default=",".join(DEFAULT_ARMS), help="comma-separated, of: " + ", ".join(ARMS)
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    p.add_argument("--layers", type=int, default=24, help="text model layers")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=4096, help="tokens per document (issue: 8192)")
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--users", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--message-tokens", type=int, default=128)
    p.add_argument("--reply-tokens", type=int, default=256)
    p.add_argument("--mm-docs", type=int, default=3)
    p.add_argument("--images", type=int, default=4, help="images per mm document")
    p.add_argument("--image-size", type=int, default=448, help="image side in pixels")
    p.add_argument("--mm-words", type=int, default=300, help="words of text per mm document")
    p.add_argument("--vision-depth", type=int, default=16)
    p.add_argument("--vision-hidden", type=int, default=512)
    p.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--offload-gib", type=float, default=1.0, help="kv_offloading_size of the vLLM arms"
    )
    p.add_argument("--tier-ram", default="1GiB", help="kvtier server --ram-bytes")
    p.add_argument("--tier-disk", default="8GiB", help="kvtier server --disk-bytes")
    p.add_argument("--seed", type=int, default=0, help="request order")
    p.add_argument("--work", type=Path, help="scratch directory (models are cached here)")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument(
        "--tiny", action="store_true", help="CI smoke run: tiny models, a few short requests"
    )
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    # SIGTERM unwinds like Ctrl-C: the tier and the engine are stopped by their PIDs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.tiny:
        args.docs, args.doc_tokens, args.question_tokens = 2, 640, 16
        args.users, args.rounds, args.system_tokens = 2, 2, 300
        args.message_tokens, args.reply_tokens = 40, 40
        args.mm_docs, args.images, args.image_size, args.mm_words = 1, 2, 224, 150
        args.kv_cache_gib = 1
    out = run(args)
    print(out["markdown"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
