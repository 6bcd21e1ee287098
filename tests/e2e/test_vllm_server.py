"""vLLM's OpenAI-compatible server with the connector: chat requests with an image over
HTTP, the repeat served from the tier, and the connector's metrics on vLLM's /metrics."""

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.redisprocs import free_port
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import prompt_text
from tests.e2e.conftest import RELAXED

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def server(vl_model: Path, module_tier: TierProcess, module_dir: Path) -> Iterator[str]:
    port = free_port()
    transfer = {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"target": module_tier.target, **RELAXED},
    }
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(vl_model), "--served-model-name", "tiny-vl",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", "4096", "--enforce-eager",
        "--no-enable-prefix-caching",  # so the repeat comes from the tier
        "--limit-mm-per-prompt", '{"image": 2, "video": 0}',
        "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(transfer),
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


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        result: dict[str, Any] = json.loads(r.read())
        return result


def _png_data_url(seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(url: str, text: str, image_seed: int) -> dict[str, Any]:
    message = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": _png_data_url(image_seed)}},
            {"type": "text", "text": text},
        ],
    }
    return _post(
        f"{url}/v1/chat/completions",
        {"model": "tiny-vl", "messages": [message], "max_tokens": 16, "temperature": 0},
    )


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def test_chat_with_image_repeated_over_http_is_served_from_tier(server: str) -> None:
    text = prompt_text(400, seed=30)
    first = _chat(server, text, image_seed=7)
    assert first["usage"]["prompt_tokens"] > 768

    full = first["usage"]["prompt_tokens"] // 256 * 256
    deadline = time.monotonic() + 60
    while True:
        # The first request's chunks are saved in the background, after its reply: a
        # repeat sent at once can find only the chunks saved so far (a shorter hit).
        second = _chat(server, text, image_seed=7)
        cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        assert cached % 256 == 0 and cached <= full, cached
        if cached == full or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    assert cached == full
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_connector_metrics_are_on_vllm_metrics_endpoint(server: str) -> None:
    names = ("lookups_total", "hit_tokens_total", "saved_bytes_total", "load_seconds_count",
             "loaded_chunks_total")  # fmt: skip
    before = {n: _metric(server, f"kvtier_connector_{n}") for n in names}

    def grew(name: str) -> float:
        return _metric(server, f"kvtier_connector_{name}") - before[name]

    text = prompt_text(400, seed=31)
    _chat(server, text, image_seed=8)
    deadline = time.monotonic() + 60
    # Saves finish after the reply (see above): repeat until a whole 768-token hit is counted.
    while grew("hit_tokens_total") < 768:
        _chat(server, text, image_seed=8)
        assert time.monotonic() < deadline, "no kvtier_connector_* hits on /metrics"
        time.sleep(0.5)

    assert grew("lookups_total") >= 2
    assert grew("saved_bytes_total") > 0
    assert grew("load_seconds_count") >= 1
    assert grew("loaded_chunks_total") >= 3
