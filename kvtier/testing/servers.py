"""Real server processes the observability tests (and tools/render_dashboard.py) scrape.

- ``VllmServer``: vLLM's OpenAI-compatible server with the kvtier connector; its
  ``/metrics`` carries vLLM's series and the connector's ``kvtier_connector_*``.
- ``Prometheus``: Debian's ``prometheus`` scraping given targets every second,
  with its HTTP API on a free 127.0.0.1 port and its data in a tmp dir.

Both are stopped by PID.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.testing.redisprocs import free_port

VLLM_START_TIMEOUT_S = 600.0  # minutes on a busy 2-core machine
PROMETHEUS_START_TIMEOUT_S = 60.0
# Generous connector deadlines: hits are what is asserted, on a busy 2-core machine.
RELAXED = {"lookup_timeout_s": 10.0, "load_timeout_s": 20.0, "save_timeout_s": 20.0}


def http_get(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return str(r.read().decode())


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass
class VllmServer:
    proc: subprocess.Popen[bytes]
    url: str
    model_name: str
    log: Path

    @classmethod
    def start(
        cls, model: Path, work_dir: Path, tier_target: str, *, model_name: str, encoder_cache: bool = False
    ) -> VllmServer:
        """``encoder_cache``: also the encoder-cache connector (a multimodal ``model``)."""
        work_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        transfer = {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.connector.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"target": tier_target, **RELAXED},
        }
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", model_name,
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "bfloat16", "--max-model-len", "4096", "--enforce-eager",
            "--no-enable-prefix-caching",  # repeats come from the tier, not vLLM's own cache
            "--kv-transfer-config", json.dumps(transfer),
        ]  # fmt: skip
        if encoder_cache:
            ec_transfer = {
                "ec_connector": "KvtierECConnector",
                "ec_connector_module_path": "kvtier.connector.ec",
                "ec_role": "ec_both",
                "ec_connector_extra_config": {"target": tier_target, **RELAXED},
            }
            args += ["--ec-transfer-config", json.dumps(ec_transfer)]
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CACHE_ROOT": str(work_dir / "vllm-cache"),
            "TMPDIR": str(work_dir),
            "TOKENIZERS_PARALLELISM": "false",
        }
        log = work_dir / "vllm-server.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work_dir)
        server = cls(proc, f"http://127.0.0.1:{port}", model_name, log)
        deadline = time.monotonic() + VLLM_START_TIMEOUT_S
        while not _up(f"{server.url}/health"):
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"vLLM server did not start:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        return server

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    def metrics(self) -> str:
        return http_get(self.metrics_url)

    def complete(self, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return self._post("/v1/completions", body)

    def chat(self, text: str, image_seed: int, max_tokens: int = 4) -> dict[str, Any]:
        """A chat turn with one picture (224x224 random pixels drawn from ``image_seed``,
        sent as a PNG: the same seed is the same file, so the same multimodal hash)."""
        content = [
            {"type": "image_url", "image_url": {"url": png_data_url(image_seed)}},
            {"type": "text", "text": text},
        ]
        body = {
            "model": self.model_name,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        return self._post("/v1/chat/completions", body)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            result: dict[str, Any] = json.loads(r.read())
            return result

    def stop(self) -> None:
        _stop(self.proc)


def png_data_url(seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass
class Prometheus:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    @classmethod
    def start(cls, work_dir: Path, targets: dict[str, str], *, binary: str = "prometheus") -> Prometheus:
        """``targets``: job name -> metrics URL (``http://host:port/path``), scraped every second."""
        work_dir.mkdir(parents=True, exist_ok=True)
        jobs = []
        for job, url in targets.items():
            parts = urllib.parse.urlsplit(url)
            jobs.append(
                {
                    "job_name": job,
                    "scrape_interval": "1s",
                    "scrape_timeout": "1s",
                    "metrics_path": parts.path or "/metrics",
                    "static_configs": [{"targets": [parts.netloc]}],
                }
            )
        # JSON is YAML: no YAML writer needed.
        return cls.start_with_config(
            work_dir, {"global": {"evaluation_interval": "1s"}, "scrape_configs": jobs}, binary=binary
        )

    @classmethod
    def start_with_config(cls, work_dir: Path, config: dict[str, Any], *, binary: str = "prometheus") -> Prometheus:
        """Prometheus with this configuration (``prometheus.yml`` as a dict), its API on a free
        127.0.0.1 port."""
        work_dir.mkdir(parents=True, exist_ok=True)
        path = work_dir / "prometheus.yml"
        path.write_text(json.dumps(config))  # JSON is YAML
        port = free_port()
        args = [
            binary,
            f"--config.file={path}",
            f"--storage.tsdb.path={work_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
        ]
        log = work_dir / "prometheus.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=work_dir)
        prom = cls(proc, f"http://127.0.0.1:{port}", log)
        deadline = time.monotonic() + PROMETHEUS_START_TIMEOUT_S
        while not _up(f"{prom.url}/-/ready"):
            if proc.poll() is not None or time.monotonic() > deadline:
                prom.stop()
                raise RuntimeError(f"prometheus did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        return prom

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets (``/api/v1/targets``): labels, discovered labels, health."""
        result: list[dict[str, Any]] = self._api("targets", state="active")["activeTargets"]
        return result

    def _api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = json.loads(http_get(url))
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{path} {params}: {exc.read().decode()}") from exc
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant vector: ``[{"metric": {...}, "value": [t, "v"]}, ...]``."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._api("query", **params)
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        """A range vector: ``[{"metric": {...}, "values": [[t, "v"], ...]}, ...]``."""
        data = self._api(
            "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s}"
        )
        result: list[dict[str, Any]] = data["result"]
        return result

    def wait_scraped(self, expr: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Waits until ``expr`` returns something (the targets were scraped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise RuntimeError(f"no result for {expr} after {timeout_s:.0f}s")
            time.sleep(0.5)

    def stop(self) -> None:
        _stop(self.proc)
