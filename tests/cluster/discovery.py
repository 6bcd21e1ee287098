"""Kubernetes service discovery for a Prometheus built without it (Debian's).

Debian's ``prometheus`` 2.42 (``2.42.0+ds``) is built without the Kubernetes discovery
(``kubernetes_sd_configs`` is "field not found" in its config: the client-go it needs is
not packaged), and it is the only Prometheus here. ``FileDiscovery`` stands in for that one
part: it turns each job's ``kubernetes_sd_configs`` into a ``file_sd_configs`` file and keeps
the file current from the API server, with the ServiceAccount token and CA the job names (so
the Prometheus ServiceAccount's RBAC is what is exercised), every second. The targets carry
the ``__meta_kubernetes_*`` labels Prometheus' own discovery gives for roles ``pod`` and
``endpoints`` (https://prometheus.io/docs/prometheus/latest/configuration/configuration/
#kubernetes_sd_config, the subset a monitor's relabelling uses), and the jobs' relabelling
rules, made from the chart's monitors, run in Prometheus unchanged.
"""

from __future__ import annotations

import copy
import json
import os
import re
import ssl
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Group = dict[str, Any]  # a file_sd target group: {"targets": [...], "labels": {...}}


def _name(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _labels(prefix: str, meta: dict[str, Any]) -> dict[str, str]:
    out = {}
    for kind in ("label", "annotation"):
        for k, v in (meta.get(f"{kind}s") or {}).items():
            out[f"{prefix}_{kind}_{_name(k)}"] = str(v)
            out[f"{prefix}_{kind}present_{_name(k)}"] = "true"
    return out


def _pod_labels(pod: dict[str, Any]) -> dict[str, str]:
    meta, status = pod["metadata"], pod.get("status") or {}
    ready = any(
        c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []
    )
    return {
        "__meta_kubernetes_namespace": meta["namespace"],
        "__meta_kubernetes_pod_name": meta["name"],
        "__meta_kubernetes_pod_ip": status.get("podIP", ""),
        "__meta_kubernetes_pod_uid": meta["uid"],
        "__meta_kubernetes_pod_node_name": pod["spec"].get("nodeName", ""),
        "__meta_kubernetes_pod_phase": status.get("phase", ""),
        "__meta_kubernetes_pod_ready": str(ready).lower(),
        **_labels("__meta_kubernetes_pod", meta),
    }


def pod_groups(pods: list[dict[str, Any]]) -> list[Group]:
    """Role ``pod``: one target per container port of every pod with an IP."""
    groups = []
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        common = _pod_labels(pod)
        for container in pod["spec"]["containers"]:
            for port in container.get("ports") or []:
                groups.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": {
                    **common,
                    "__meta_kubernetes_pod_container_name": container["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                    "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP"),
                }})  # fmt: skip
    return groups


def endpoints_groups(
    endpoints: list[dict[str, Any]], services: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> list[Group]:
    """Role ``endpoints``: one target per address and port of every Endpoints object, with its
    Service's labels and, for a pod address, the pod's (and the container's that has the port)."""
    by_service = {(s["metadata"]["namespace"], s["metadata"]["name"]): s for s in services}
    by_pod = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
    groups = []
    for ep in endpoints:
        meta = ep["metadata"]
        ns = meta["namespace"]
        service = by_service.get((ns, meta["name"]))
        common = {
            "__meta_kubernetes_namespace": ns,
            "__meta_kubernetes_endpoints_name": meta["name"],
            **_labels("__meta_kubernetes_endpoints", meta),
        }
        if service is not None:
            common["__meta_kubernetes_service_name"] = meta["name"]
            common.update(_labels("__meta_kubernetes_service", service["metadata"]))
        for subset in ep.get("subsets") or []:
            addresses = [(a, "true") for a in subset.get("addresses") or []]
            addresses += [(a, "false") for a in subset.get("notReadyAddresses") or []]
            for address, ready in addresses:
                ref = address.get("targetRef") or {}
                pod = by_pod.get((ns, ref.get("name", ""))) if ref.get("kind") == "Pod" else None
                for port in subset.get("ports") or []:
                    labels = {
                        **common,
                        "__meta_kubernetes_endpoint_port_name": port.get("name", ""),
                        "__meta_kubernetes_endpoint_port_protocol": port.get("protocol", "TCP"),
                        "__meta_kubernetes_endpoint_ready": ready,
                        "__meta_kubernetes_endpoint_address_target_kind": ref.get("kind", ""),
                        "__meta_kubernetes_endpoint_address_target_name": ref.get("name", ""),
                    }
                    if pod is not None:
                        labels.update(_pod_labels(pod))
                        for container in pod["spec"]["containers"]:
                            for cport in container.get("ports") or []:
                                if cport["containerPort"] == port["port"]:
                                    labels["__meta_kubernetes_pod_container_name"] = container[
                                        "name"
                                    ]
                                    labels["__meta_kubernetes_pod_container_port_name"] = cport.get(
                                        "name", ""
                                    )
                    groups.append({"targets": [f"{address['ip']}:{port['port']}"], "labels": labels})  # fmt: skip
    return groups


@dataclass(frozen=True)
class _Watch:
    file: Path
    role: str
    namespaces: tuple[str, ...]  # empty: all
    api_server: str
    ca_file: str
    token_file: str


@dataclass
class FileDiscovery:
    """``with FileDiscovery(dir) as d: config["scrape_configs"] = d.rewrite(jobs)``."""

    directory: Path
    interval_s: float = 1.0
    errors: list[str] = field(default_factory=list)
    _watches: list[_Watch] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def rewrite(self, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The jobs with each ``kubernetes_sd_configs`` entry replaced by a file this keeps
        current; written once before returning, so Prometheus starts with targets."""
        self.directory.mkdir(parents=True, exist_ok=True)
        out = []
        for job in jobs:
            job = copy.deepcopy(job)
            files = []
            for sd in job.pop("kubernetes_sd_configs", []):
                watch = _Watch(
                    self.directory / f"{len(self._watches)}.json", sd["role"],
                    tuple(sd.get("namespaces", {}).get("names", ())), sd["api_server"],
                    sd["tls_config"]["ca_file"], sd["authorization"]["credentials_file"],
                )  # fmt: skip
                self._watches.append(watch)
                files.append(str(watch.file))
            if files:
                job["file_sd_configs"] = [{"files": files, "refresh_interval": "1s"}]
            out.append(job)
        self.refresh()
        return out

    def __enter__(self) -> FileDiscovery:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception as exc:  # keep the last good files; the test reads self.errors
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def refresh(self) -> None:
        for watch in self._watches:
            groups = self._groups(watch)
            tmp = watch.file.with_suffix(".tmp")
            tmp.write_text(json.dumps(groups))
            os.replace(tmp, watch.file)  # Prometheus sees a whole file or the old one

    def _groups(self, watch: _Watch) -> list[Group]:
        def items(resource: str) -> list[dict[str, Any]]:
            namespaces = watch.namespaces or (None,)
            out: list[dict[str, Any]] = []
            for ns in namespaces:
                path = f"/api/v1/namespaces/{ns}/{resource}" if ns else f"/api/v1/{resource}"
                out += self._get(watch, path)["items"]
            return out

        if watch.role == "pod":
            return pod_groups(items("pods"))
        if watch.role == "endpoints":
            return endpoints_groups(items("endpoints"), items("services"), items("pods"))
        raise ValueError(f"role {watch.role!r}: only pod and endpoints are discovered here")

    @staticmethod
    def _get(watch: _Watch, path: str) -> dict[str, Any]:
        context = ssl.create_default_context(cafile=watch.ca_file)
        token = Path(watch.token_file).read_text().strip()
        request = urllib.request.Request(
            watch.api_server + path, headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]
