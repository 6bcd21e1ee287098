"""The engine process of ``kvtier.testing.engine``: an in-process vLLM ``LLM`` that answers
the parent's commands (JSON lines on stdin) on its own stdout, one reply per command
(``{"result": ...}`` or ``{"error": "Type: message"}``); vLLM's prints and logs go to
stderr (the engine's log file). Run as ``python -m kvtier.testing.engine_serve SPEC``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

SAVE_WAIT_S = 120.0
"""How long ``measure`` waits for the connector's background saves."""


def _image(recipe: dict[str, Any]) -> Any:
    import numpy as np
    from PIL import Image

    width, height = recipe.get("size", (224, 224))
    rng = np.random.default_rng(recipe["seed"])
    picture = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    if not recipe.get("png"):
        return picture
    # As vLLM's server loads an uploaded PNG: its mm hash is over the file's bytes.
    import io

    from vllm.multimodal.media.image import ImageMediaIO

    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    return ImageMediaIO(image_mode="RGB").load_bytes(buf.getvalue())


def _kvtier_worker() -> Any:
    """The worker-side kvtier KV connector; None without one (no connector, or one of
    vLLM's own, e.g. its offloading)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group() or not hasattr(get_kv_transfer_group(), "recorder"):
        return None
    return get_kv_transfer_group()


def _connector_stats() -> dict[str, float]:
    worker = _kvtier_worker()
    if worker is None:
        return {}
    totals: dict[str, float] = worker.recorder.totals()
    for key, value in _scheduler_connector().recorder.totals().items():
        totals[key] = totals.get(key, 0) + value
    return totals


def _audio(recipe: dict[str, Any]) -> Any:
    import numpy as np

    rng = np.random.default_rng(recipe["seed"])
    rate = 16000  # other rates need torchaudio to resample (absent here)
    return (rng.uniform(-0.5, 0.5, int(rate * recipe.get("seconds", 1.0))).astype(np.float32), rate)


def _ec_stats() -> dict[str, float]:
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

    if not has_ec_transfer():
        return {}
    totals: dict[str, float] = get_ec_transfer().recorder.totals()  # type: ignore[attr-defined]
    scheduler = _LLM.llm_engine.engine_core.engine_core.scheduler.ec_connector
    for key, value in scheduler.recorder.totals().items():
        totals[key] = totals.get(key, 0) + value
    return totals


# The encoder's attribute path on vLLM's model, per architecture (Idefics3 nests its ViT).
ENCODER_MODULES = ("visual", "vision_tower", "audio_tower", "model.vision_model")
_ENCODER_CALLS = [0]
_ENCODER_SECONDS = [0.0, 0.0]  # total, start of the running call


def _count_encoder_calls(llm: Any) -> None:
    """Forward hooks on the model's encoder: prove whether an engine ran it, and time it."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    model = runner.model_runner.get_model()
    for path in ENCODER_MODULES:
        module = model
        for name in path.split("."):
            module = getattr(module, name, None)
        if module is not None:

            def before(*_: Any) -> None:
                _ENCODER_SECONDS[1] = time.perf_counter()

            def hook(*_: Any) -> None:
                _ENCODER_CALLS[0] += 1
                _ENCODER_SECONDS[0] += time.perf_counter() - _ENCODER_SECONDS[1]

            module.register_forward_pre_hook(before)
            module.register_forward_hook(hook)
            return


_LLM: Any = None


_LAST_KEYS: list[list[bytes]] = []  # per chunk, per KV cache group (rank 0)


def _record_chunk_keys() -> None:
    """Remember the chunk keys (rank 0, every KV cache group) of the last request the KV
    connector keyed, so a test can reach a multimodal prompt's chunks in the tier
    (``last_chunk_keys``)."""
    scheduler = _scheduler_connector().scheduler
    keys_of = scheduler._keys

    def recorded(request: Any) -> Any:
        keys = keys_of(request)
        if keys:
            _LAST_KEYS[:] = [[group[0] for group in k] for k in keys]
        return keys

    scheduler._keys = recorded


def _scheduler_connector() -> Any:
    return _LLM.llm_engine.engine_core.engine_core.scheduler.connector


def _prompt(p: dict[str, Any]) -> dict[str, Any]:
    """vLLM's prompt for one of the harness's (token ids or text, salt, image and audio recipes)."""
    prompt: dict[str, Any] = (
        {"prompt_token_ids": p["prompt_token_ids"]}
        if "prompt_token_ids" in p
        else {"prompt": p["prompt"]}
    )
    if p.get("cache_salt"):
        prompt["cache_salt"] = p["cache_salt"]
    if p.get("images"):
        prompt["multi_modal_data"] = {"image": [_image(i) for i in p["images"]]}
    if p.get("audios"):
        prompt.setdefault("multi_modal_data", {})["audio"] = [_audio(a) for a in p["audios"]]
    return prompt


def _kv_cache_groups() -> dict[str, Any]:
    """The engine's KV cache groups as its scheduler holds them, and whether vLLM's
    hybrid KV cache manager is on (its own config)."""
    core = _LLM.llm_engine.engine_core.engine_core
    config = core.scheduler.kv_cache_config
    return {
        "hybrid_manager": not core.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "num_blocks": config.num_blocks,
        "groups": [
            {
                "spec": type(g.kv_cache_spec).__name__,
                "layers": len(g.layer_names),
                "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
                "block_size": g.kv_cache_spec.block_size,
                "page_bytes": g.kv_cache_spec.page_size_bytes,
            }
            for g in config.kv_cache_groups
        ],
    }


def _kv_nonfinite() -> dict[str, Any]:
    """Every block of the engine's KV cache (each tensor once, the null block included)
    that holds a NaN or an infinity: ``blocks`` scanned and ``found``, up to 20 of
    ``[tensor, block]``. vLLM's CPU attention reads the unwritten slots of a request's
    blocks too (``kvtier.bench.nanslots``), so such a value anywhere, even where no
    request has read it yet, turns a later request's output to token 0s (issue 21,
    defect 1)."""
    import torch

    from kvtier.connector.chunks.finite import NONFINITE_BITS

    runner = _LLM.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    seen: set[int] = set()
    scanned, found = 0, []
    tensors = [t for entry in runner.kv_caches for t in (entry if isinstance(entry, list | tuple) else [entry])]
    for index, tensor in enumerate(tensors):  # (a Mamba layer's entry is a list of states)
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        # An exponent of all ones is a NaN or an infinity (the connector's masks): twice as
        # fast as isfinite on bf16. Other dtypes (an fp8 cache's uint8 bytes) by isfinite.
        bits = NONFINITE_BITS.get(str(tensor.dtype).removeprefix("torch."))
        for start in range(0, tensor.shape[0], 1024):  # a slice at a time: bounded memory
            part = tensor[start : start + 1024]
            if bits is None:
                nonfinite = ~torch.isfinite(part)
            else:
                width, mask = bits
                view = part.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[width])
                nonfinite = (view & mask) == mask
            bad = nonfinite.flatten(1).any(dim=1).nonzero().flatten()
            found.extend([index, start + int(b)] for b in bad[: max(0, 20 - len(found))])
            scanned += part.shape[0]
    if not scanned:  # a scan of nothing would pass whatever the KV cache held
        raise RuntimeError("kv_nonfinite: the model runner holds no KV cache tensor")
    return {"blocks": scanned, "found": found}


def _kv_blocks(p: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """Run one prompt alone, an engine step at a time, and read from vLLM's KV cache
    manager the blocks the request holds in each group after every step: the peak, and
    what it holds at its last step (prompt computed, decoding). Bytes per block of a
    group: its page size times its layers."""
    from vllm import SamplingParams

    engine = _LLM.llm_engine
    managers = engine.engine_core.engine_core.scheduler.kv_cache_manager.coordinator
    managers = managers.single_type_managers
    engine.add_request("kv-blocks", _prompt(p), SamplingParams(max_tokens=max_tokens, temperature=0))
    held: list[list[int]] = []
    while engine.has_unfinished_requests():
        engine.step()
        now = [
            sum(not b.is_null for blocks in m.req_to_blocks.values() for b in blocks)
            for m in managers
        ]
        if any(now):
            held.append(now)
    return {
        "peak": [max(step[g] for step in held) for g in range(len(managers))],
        "last": held[-1],
        "block_bytes": [
            g["page_bytes"] * g["layers"] for g in _kv_cache_groups()["groups"]
        ],
    }


def _measure(p: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = _prompt(p)
    started = time.perf_counter()
    (out,) = _LLM.generate([prompt], params, use_tqdm=False)
    ttft = time.perf_counter() - started
    save_wait = 0.0
    worker = _kvtier_worker()
    if worker is not None:
        started = time.perf_counter()
        worker.worker.sender.flush(SAVE_WAIT_S)
        save_wait = time.perf_counter() - started
    return {
        "ttft_s": ttft,
        "save_wait_s": save_wait,
        "token": out.outputs[0].token_ids[0],
        "cached_tokens": int(out.num_cached_tokens or 0),
        "prompt_tokens": len(out.prompt_token_ids or ()),
    }


def _serve(spec: dict[str, Any]) -> None:
    global _LLM
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's prints and logs go to the log file, replies to the parent

    def reply(**message: Any) -> None:
        proto.write(json.dumps(message) + "\n")
        proto.flush()

    try:
        _LLM = _start(spec)
        if spec["extra_config"] is not None:
            _record_chunk_keys()
    except Exception as exc:
        import traceback

        traceback.print_exc()
        reply(error=f"{type(exc).__name__}: {exc}")
        return
    reply(result="ready")
    for line in sys.stdin:
        message = json.loads(line)
        try:
            reply(result=_command(message))
        except Exception as exc:
            import traceback

            traceback.print_exc()
            reply(error=f"{type(exc).__name__}: {exc}")


def _start(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "max_model_len": 4096,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "seed": 0,
        "dtype": "bfloat16",
    }
    if spec["multimodal"]:
        kwargs["limit_mm_per_prompt"] = spec.get("limit_mm_per_prompt") or {"image": 2, "video": 0}
    kwargs.update(spec.get("llm_kwargs") or {})
    if spec.get("ec_extra_config") is not None:
        from vllm.config import ECTransferConfig

        kwargs["ec_transfer_config"] = ECTransferConfig(
            ec_connector="KvtierECConnector",
            ec_connector_module_path="kvtier.connector.ec",
            ec_role=spec["ec_role"],
            ec_connector_extra_config=spec["ec_extra_config"],
        )
    if spec["extra_config"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector",
            kv_connector_module_path="kvtier.connector.vllm",
            kv_role=spec["kv_role"],
            kv_connector_extra_config=spec["extra_config"],
        )
    llm = LLM(**kwargs)
    if spec["multimodal"]:
        _count_encoder_calls(llm)
    return llm


def _command(message: dict[str, Any]) -> Any:
    """The result of one command from the parent."""
    cmd = message["cmd"]
    if cmd == "generate":
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=message["max_tokens"], temperature=0.0)
        prompts = [_prompt(p) for p in message["prompts"]]
        outputs = _LLM.generate(prompts, params, use_tqdm=False)
        return [
            {
                "token_ids": list(o.outputs[0].token_ids),
                "num_cached_tokens": int(o.num_cached_tokens or 0),
                "num_prompt_tokens": len(o.prompt_token_ids or ()),
            }
            for o in outputs
        ]
    if cmd == "measure":
        return _measure(message["prompt"])
    if cmd == "tokenize":
        return _LLM.get_tokenizer().encode(message["prompt"])
    if cmd == "chunk_keys":
        # The keys the connector computes for a text prompt (rank 0), in hex.
        from types import SimpleNamespace

        ids = message.get("prompt_token_ids") or _LLM.get_tokenizer().encode(message["prompt"])
        request = SimpleNamespace(prompt_token_ids=ids, mm_features=[], cache_salt=None)
        keys = _scheduler_connector().scheduler._keys(request)
        return [k[0][0].hex() for k in keys]  # the first KV cache group's
    if cmd == "kv_cache_groups":
        return _kv_cache_groups()
    if cmd == "kv_nonfinite":
        return _kv_nonfinite()
    if cmd == "kv_blocks":
        return _kv_blocks(message["prompt"], message["max_tokens"])
    if cmd == "last_chunk_keys":
        return [k[message.get("group", 0)].hex() for k in _LAST_KEYS]
    if cmd == "receive_buffers":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        buffers = get_kv_transfer_group()._tier.client._buffers
        return {"reused": buffers.reused, "bytes": buffers.bytes}
    if cmd == "stats":
        return _connector_stats()
    if cmd == "ec_stats":
        return _ec_stats()
    if cmd == "encoder_calls":
        return _ENCODER_CALLS[0]
    if cmd == "encoder_seconds":
        return _ENCODER_SECONDS[0]
    if cmd == "ec_flush":
        from vllm.distributed.ec_transfer import get_ec_transfer

        return get_ec_transfer().worker.sender.flush(30.0)  # type: ignore[attr-defined]
    if cmd == "flush":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().worker.sender.flush(30.0)
    raise ValueError(f"unknown command {cmd!r}")


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
