"""vLLM's OpenAI-compatible server with the encoder-cache connector: a chat whose image
another engine encoded is served from the tier, and the kvtier_connector_ec_* series
are on vLLM's /metrics (counted by the worker half, shipped through the scheduler half)."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.engine import EngineProcess
from kvtier.testing.redisprocs import free_port
from kvtier.testing.tierproc import TierProcess
from tests.ec.conftest import IMAGE, RELAXED, chat, image

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def server(vl_model: Path, module_tier: TierProcess, module_dir: Path) -> Iterator[str]:
    port = free_port()
    transfer = {
        "ec_connector": "KvtierECConnector",
        "ec_connector_module_path": "kvtier.connector.ec",
        "ec_role": "ec_both",
        "ec_connector_extra_config": {"target": module_tier.target, **RELAXED},
    }
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(vl_model), "--served-model-name", "tiny-vl",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", "4096", "--enforce-eager",
        "--no-enable-prefix-caching",
        "--limit-mm-per-prompt", '{"image": 2, "video": 0}',
        "--ec-transfer-config", json.dumps(transfer),
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CACHE_ROOT": str(module_dir.parent / "vllm-cache"),
        "TMPDIR": str(module_dir),
    }
    log = module_dir / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=module_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vLLM server did not start:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _png_data_url(seed: int) -> str:
    """The picture ``kvtier.testing.engine`` draws for ``image(seed)``, as a lossless PNG."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(url: str, seed: int) -> dict[str, Any]:
    message = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": _png_data_url(seed)}},
            {"type": "text", "text": "describe"},
        ],
    }
    body = {"model": "tiny-vl", "messages": [message], "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        result: dict[str, Any] = json.loads(r.read())
        return result


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def test_the_ec_series_are_on_vllms_metrics_at_zero_before_any_image(server: str) -> None:
    with urllib.request.urlopen(f"{server}/metrics", timeout=10) as r:
        text = r.read().decode()
    for name in ("lookups_total", "hits_total", "loaded_bytes_total", "load_seconds_count"):
        assert f"kvtier_connector_ec_{name}{{" in text, name
    assert _metric(server, "kvtier_connector_ec_breaker_open") == 0
    assert "kvtier_connector_ec_breaker_open{" in text


def test_an_image_another_engine_encoded_is_served_from_the_tier_and_counted(
    server: str,
    vl_model: Path,
    module_tier: TierProcess,
    start_engine: Callable[..., EngineProcess],
) -> None:
    config = {"target": module_tier.target, **RELAXED}
    other = start_engine(vl_model, name="other", ec_extra_config=config, multimodal=True)
    png = {**image(9), "png": True}  # the server hashes an upload's bytes, not its pixels
    other.generate([{"prompt": chat(IMAGE, "describe"), "images": [png]}])
    other.ec_flush()
    other.close()

    _chat(server, seed=9)  # a hit
    _chat(server, seed=10)  # a miss: encoded and saved
    deadline = time.monotonic() + 60
    while _metric(server, "kvtier_connector_ec_saved_bytes_total") == 0:
        assert time.monotonic() < deadline, "the miss was never saved"
        _chat(server, seed=10)  # a step ships the worker's save counters
        time.sleep(0.5)

    assert _metric(server, "kvtier_connector_ec_hits_total") == 1
    assert _metric(server, "kvtier_connector_ec_lookups_total") == 2
    assert _metric(server, "kvtier_connector_ec_loaded_bytes_total") > 0
    assert _metric(server, "kvtier_connector_ec_load_seconds_count") >= 1
