"""A small async client for the Kubernetes REST API: server-side apply, get, delete.

It speaks to the API server over the same credentials kopf uses
(``kopf.ConnectionInfo``: a kubeconfig or the pod's service account). Only the
kinds in ``KINDS`` are known: those the operator and its tests touch.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import aiohttp
import kopf

from kvtier.operator.errors import Conflict, Invalid, KubeError, NotFound

logger = logging.getLogger(__name__)

FIELD_MANAGER = "kvtier-operator"
Obj = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    """Where a kind lives in the REST API."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None = None, name: str | None = None, sub: str = "") -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        parts = [base]
        if self.namespaced and namespace is not None:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name is not None:
            parts.append(name)
        if sub:
            parts.append(sub)
        return "/".join(parts)


KINDS = {
    (kind.api_version, kind.kind): kind
    for kind in (
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Secret", "secrets"),
        Kind("v1", "Service", "services"),
        Kind("v1", "Pod", "pods"),
        Kind("v1", "Event", "events"),
        Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims"),
        Kind("v1", "Namespace", "namespaces", namespaced=False),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("apps/v1", "StatefulSet", "statefulsets"),
        Kind("apps/v1", "DaemonSet", "daemonsets"),
        Kind("apps/v1", "ReplicaSet", "replicasets"),
        Kind("kvtier.io/v1alpha1", "CacheTier", "cachetiers"),
        Kind("kvtier.io/v1alpha1", "ModelRecipe", "modelrecipes"),
        Kind(
            "apiextensions.k8s.io/v1",
            "CustomResourceDefinition",
            "customresourcedefinitions",
            namespaced=False,
        ),
        Kind("rbac.authorization.k8s.io/v1", "ClusterRole", "clusterroles", namespaced=False),
        Kind(
            "rbac.authorization.k8s.io/v1",
            "ClusterRoleBinding",
            "clusterrolebindings",
            namespaced=False,
        ),
    )
}


def kind_of(api_version: str, kind: str) -> Kind:
    try:
        return KINDS[(api_version, kind)]
    except KeyError:
        raise ValueError(
            f"unknown kind {api_version}/{kind}: add it to kvtier.operator.kube.KINDS"
        ) from None


def kind_for(obj: Mapping[str, Any]) -> Kind:
    return kind_of(obj["apiVersion"], obj["kind"])


class KubeClient:
    """Async REST calls to one API server; errors become ``KubeError`` subclasses."""

    def __init__(self, session: aiohttp.ClientSession, server: str) -> None:
        self._session = session
        self._server = server.rstrip("/")

    @classmethod
    def from_connection_info(cls, info: kopf.ConnectionInfo, *, timeout: float = 30) -> KubeClient:
        with warnings.catch_warnings():  # deprecated in favour of aiohttp's own helper
            warnings.simplefilter("ignore", DeprecationWarning)
            auth = info.as_aiohttp_basic_auth()
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
            headers=info.as_http_headers(),
            auth=auth,
            timeout=aiohttp.ClientTimeout(total=timeout),
        )
        return cls(session, info.server)

    async def close(self) -> None:
        await self._session.close()

    async def get(self, kind: Kind, namespace: str | None, name: str) -> Obj | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", kind.path(namespace, name))
        except NotFound:
            return None

    async def list(self, kind: Kind, namespace: str | None, label_selector: str = "") -> list[Obj]:
        query = {"labelSelector": label_selector} if label_selector else {}
        result = await self.request("GET", kind.path(namespace), query=query)
        return list(result.get("items", []))

    async def apply(self, obj: Mapping[str, Any], *, field_manager: str = FIELD_MANAGER) -> Obj:
        """Create or update ``obj`` with server-side apply, taking over conflicting fields."""
        meta = obj["metadata"]
        return await self.request(
            "PATCH",
            kind_for(obj).path(meta.get("namespace"), meta["name"]),
            body=obj,
            content_type="application/apply-patch+yaml",  # JSON is YAML
            query={"fieldManager": field_manager, "force": "true"},
        )

    async def create(self, obj: Mapping[str, Any]) -> Obj:
        return await self.request(
            "POST", kind_for(obj).path(obj["metadata"].get("namespace")), body=obj
        )

    async def patch(
        self,
        kind: Kind,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        *,
        sub: str = "",
    ) -> Obj:
        """A JSON merge patch, of the object or of a subresource (``status``)."""
        return await self.request(
            "PATCH", kind.path(namespace, name, sub), body=patch,
            content_type="application/merge-patch+json",
        )  # fmt: skip

    async def delete(
        self, kind: Kind, namespace: str | None, name: str, *, propagation: str = "Background"
    ) -> bool:
        """Delete; False when it was not there."""
        try:
            await self.request(
                "DELETE", kind.path(namespace, name), body={"propagationPolicy": propagation}
            )
        except NotFound:
            return False
        return True

    async def version(self) -> tuple[int, int]:
        """(major, minor) of the API server."""
        info = await self.request("GET", "/version")
        return int(info["major"]), int(str(info["minor"]).rstrip("+"))

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | Sequence[Any] | None = None,  # a JSON patch is a list
        content_type: str = "application/json",
        query: Mapping[str, str] | None = None,
        accept: str = "application/json",
    ) -> Obj:
        url = self._server + path + (f"?{urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body)
        headers = {"Accept": accept}
        if data is not None:
            headers["Content-Type"] = content_type
        try:
            async with self._session.request(method, url, data=data, headers=headers) as response:
                text = await response.text()
                status = response.status
        except aiohttp.ClientError as exc:
            raise KubeError(0, "ConnectionError", f"{method} {path}: {exc}") from exc
        try:
            payload: Obj = json.loads(text) if text else {}
        except ValueError:
            payload = {"message": text[:200]}
        if status >= 400:
            raise _error(status, payload, f"{method} {path}")
        return payload


def _error(status: int, payload: Mapping[str, Any], what: str) -> KubeError:
    reason = str(payload.get("reason", "Unknown"))
    message = f"{what}: {payload.get('message', '')}"
    error_class = {404: NotFound, 409: Conflict, 422: Invalid}.get(status, KubeError)
    return error_class(status, reason, message)
