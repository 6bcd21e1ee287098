"""What tests/cluster/test_user_story.py reads from the cluster and sends to it.

- ``Metrics``: a pod's ``/metrics`` page, read through its pod IP (from this machine, over
  the cluster's bridge), summed by name and labels.
- ``Traffic``: the same chat request with an image, sent again and again to the engine's
  Service in a thread while a fault happens; every answer (or error) is kept.
- ``scrape_configs``: Prometheus jobs equivalent to the chart's PodMonitor and
  ServiceMonitor (what the Prometheus operator would generate from them): Kubernetes
  service discovery against the cluster's API server, the monitors' label selectors,
  namespaces, ports and paths as relabelling rules.
- ``disk_keys``: the keys a tier's disk tier holds, per tenant, read from the records in its
  volume's directory (this machine is the node).
"""

from __future__ import annotations

import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvtier.testing.chat import Answer, chat

NS = "kvtier"  # the release's namespace (README.md's quickstart)
RECIPE = "tiny-vl"  # recipes/local/tiny-qwen2_5_vl.yaml
MODEL = "kvtier-test/tiny-qwen2.5-vl"  # its spec.model.repo: the served name
TIER = "kvtier"  # the chart's default CacheTier
ENGINE_SELECTOR = f"app.kubernetes.io/component=engine,kvtier.io/modelrecipe={RECIPE}"
TIER_SELECTOR = f"app.kubernetes.io/component=cache-tier,kvtier.io/cachetier={TIER}"
ENGINE_PORT, TIER_METRICS_PORT = 8000, 9400


@dataclass(frozen=True)
class Metrics:
    samples: tuple[tuple[str, dict[str, str], float], ...]

    @classmethod
    def read(cls, ip: str, port: int, timeout_s: float = 10) -> Metrics:
        with urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
        return cls(
            tuple(
                (s.name, dict(s.labels), float(s.value))
                for family in text_string_to_metric_families(text)
                for s in family.samples
            )
        )

    def get(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels``."""
        return sum(
            value
            for n, have, value in self.samples
            if n == name and all(have.get(k) == v for k, v in labels.items())
        )

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.samples)


@dataclass
class Sent:
    at: float
    answer: Answer | None
    error: str | None = None


@dataclass
class Traffic:
    """The same request, again and again, from a thread (``with Traffic(...) as t:``)."""

    url: str
    text: str
    image_seed: int
    pause_s: float = 0.5
    sent: list[Sent] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=400)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                answer = chat(self.url, MODEL, self.text, self.image_seed)
                self.sent.append(Sent(time.time(), answer))
            except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
                self.sent.append(Sent(time.time(), None, f"{type(exc).__name__}: {exc}"))
            self._stop.wait(self.pause_s)

    def wait_for(self, what: str, done: Any, timeout_s: float) -> None:
        """Keep sending until ``done(self.sent)`` is true."""
        deadline = time.monotonic() + timeout_s
        while not done(self.sent):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; sent: {self.summary()}")
            time.sleep(1)

    def summary(self) -> str:
        return ", ".join(
            f"{s.answer.cached_tokens}c" if s.answer else f"ERR({s.error})" for s in self.sent
        )


def _label(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def scrape_configs(
    monitors: Iterable[dict[str, Any]],
    api_server: str,
    ca_file: Path,
    token_file: Path,
    interval: str,
) -> list[dict[str, Any]]:
    """Prometheus jobs doing what the Prometheus operator makes of these PodMonitors and
    ServiceMonitors (role ``pod``/``endpoints``, the selector's labels, the namespaces, the
    port by name, the path), at ``interval`` instead of the monitor's own."""
    jobs = []
    for monitor in monitors:
        kind, spec = monitor["kind"], monitor["spec"]
        pod_monitor = kind == "PodMonitor"
        subject = "pod" if pod_monitor else "service"
        sd: dict[str, Any] = {
            "role": "pod" if pod_monitor else "endpoints",
            "api_server": api_server,
            "tls_config": {"ca_file": str(ca_file)},
            "authorization": {"credentials_file": str(token_file)},
        }
        names = spec.get("namespaceSelector", {}).get("matchNames")
        if names:
            sd["namespaces"] = {"names": list(names)}
        keep = [
            {
                "source_labels": [
                    f"__meta_kubernetes_{subject}_label_{_label(k)}",
                    f"__meta_kubernetes_{subject}_labelpresent_{_label(k)}",
                ],
                "regex": f"({re.escape(v)});true",
                "action": "keep",
            }
            for k, v in spec["selector"]["matchLabels"].items()
        ]
        endpoints = spec["podMetricsEndpoints"] if pod_monitor else spec["endpoints"]
        port_label = (
            "__meta_kubernetes_pod_container_port_name"
            if pod_monitor
            else "__meta_kubernetes_endpoint_port_name"
        )
        for i, endpoint in enumerate(endpoints):
            relabel = [
                *keep,
                {"source_labels": [port_label], "regex": endpoint["port"], "action": "keep"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {
                    "source_labels": ["__meta_kubernetes_pod_container_name"],
                    "target_label": "container",
                },
                {"target_label": "endpoint", "replacement": endpoint["port"]},
            ]
            if not pod_monitor:
                relabel.append(
                    {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"}
                )
            meta = monitor["metadata"]
            jobs.append({
                "job_name": f"{kind.lower()}/{meta['namespace']}/{meta['name']}/{i}",
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "metrics_path": endpoint.get("path", "/metrics"),
                "kubernetes_sd_configs": [sd],
                "relabel_configs": relabel,
            })  # fmt: skip
    return jobs


def disk_keys(volume_dir: Path) -> dict[str, list[bytes]]:
    """tenant -> the keys its entries have in a disk tier's directory (the records' headers:
    kvtier.cacheserver.record and .namespace, read as bytes so the test needs no server code)."""
    out: dict[str, list[bytes]] = {}
    for path in sorted((volume_dir / "v1").glob("*/*")):
        head = path.read_bytes()[:600]
        if head[:4] != b"KVTR":
            continue
        key_len = int.from_bytes(head[6:8], "little")
        scoped = head[24 : 24 + key_len]
        tenant = scoped[1 : 1 + scoped[0]].decode()
        out.setdefault(tenant, []).append(scoped[1 + scoped[0] :])
    return out


def panel_targets(dashboards: dict[str, dict[str, Any]]) -> Iterator[tuple[str, str, str]]:
    """(dashboard, panel title, expr) of every panel query."""
    for stem, dashboard in dashboards.items():
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                yield stem, panel["title"], target["expr"]
