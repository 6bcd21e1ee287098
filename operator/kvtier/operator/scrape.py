"""Reading the ``/metrics`` pages of a resource's ready pods, bounded in time and size.

The operator reads engine pods' vLLM ``/metrics`` (the connector's series) and tier
pods' ``kvtier server`` ``/metrics`` through their pod IPs, all pods of one
resource at once, each read within ``timeout_s``. A pod that does not answer, answers
with an error, or serves something that is not the Prometheus text format is a
``str`` saying why, never an exception: traffic is reported as far as it is known.

The session is not the API server's: pods never see the operator's credentials.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvtier.operator.promtext import MetricsFormatError, Sample, parse

METRICS_TIMEOUT_S = 2.0  # per pod; all pods of a resource are read at once
MAX_PAGE_BYTES = 8 << 20  # a vLLM page is ~100 KiB; anything this large is not one

Page = list[Sample] | str  # the samples, or why there are none


@dataclass(frozen=True)
class PodAddress:
    name: str
    ip: str


def ready_pods(pods: Sequence[Mapping[str, Any]]) -> list[PodAddress]:
    """The pods that are Ready, have an IP and are not being deleted, by name."""
    out = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        conditions = status.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        if ready and status.get("podIP") and not meta.get("deletionTimestamp"):
            out.append(PodAddress(str(meta.get("name", "")), str(status["podIP"])))
    return sorted(out, key=lambda pod: pod.name)


def metrics_url(ip: str, port: int) -> str:
    host = f"[{ip}]" if ":" in ip else ip  # an IPv6 pod IP
    return f"http://{host}:{port}/metrics"


class MetricsReader:
    """Reads ``/metrics`` pages; one per operator, closed at shutdown."""

    def __init__(self, timeout_s: float = METRICS_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            connector=aiohttp.TCPConnector(limit=64, force_close=True),
        )

    async def close(self) -> None:
        await self._session.close()

    async def read_all(self, pods: Sequence[PodAddress], port: int) -> dict[str, Page]:
        """Every pod's page (or why not), read at once; returns within ``timeout_s``."""
        pages = await asyncio.gather(*(self.read(metrics_url(p.ip, port)) for p in pods))
        return {pod.name: page for pod, page in zip(pods, pages, strict=True)}

    async def read(self, url: str) -> Page:
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._session.get(url, headers={"Accept": "text/plain"}) as response:
                    if response.status != 200:
                        return f"HTTP {response.status}"
                    body = await _read_page(response)
        except TimeoutError:
            return f"no answer within {self.timeout_s:g} s"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return type(exc).__name__ + (f": {exc}" if str(exc) else "")
        if len(body) > MAX_PAGE_BYTES:
            return f"a page larger than {MAX_PAGE_BYTES >> 20} MiB"
        try:
            return parse(body.decode("utf-8", errors="replace"))
        except MetricsFormatError as exc:
            return f"not Prometheus metrics ({exc})"


async def _read_page(response: aiohttp.ClientResponse) -> bytes:
    """The whole body, up to one byte past ``MAX_PAGE_BYTES``. ``content.read(n)`` returns
    what has arrived so far, not n bytes: a page sent in pieces (vLLM's ~80 KiB one, seen on
    a real node) would be cut mid-line."""
    body = bytearray()
    async for piece in response.content.iter_chunked(1 << 16):
        body += piece
        if len(body) > MAX_PAGE_BYTES:
            break
    return bytes(body)
