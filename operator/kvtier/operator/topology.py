"""A per-node tier (``spec.topology: perNode``): one tier pod per node, its socket node-local.

Engines use their node's tier through the same-node transport (docs/protocol.md,
"Same-node transport"). The contract between the parts:

- the tier listens on the Unix socket ``--local-socket`` (``KVTIER_LOCAL_SOCKET``),
  ``/run/kvtier/tier.sock``, removing a stale socket file before it binds and making
  the socket group-writable (0660; the group is the tier's, 65532);
- the connector tries the extra-config key ``local_socket`` (that path) first and
  uses ``target`` (the tier's Service, over TCP) where nothing listens on it.

The directory is ``/var/run/kvtier/<namespace>/<tier>`` on the node (a hostPath,
``DirectoryOrCreate``), mounted at ``/run/kvtier`` in the tier's pod and in the
pods of every engine whose recipe uses the tier. The kubelet creates it owned by
root, mode 0755: an init container (root, no capability but CHOWN and FOWNER, no
privilege escalation, read-only root) hands it to the tier's user, mode 0750;
engines reach the socket through the tier's group (``supplementalGroups``). No
pod runs privileged, on the host network, IPC or PID namespace.

Kubernetes 1.20 has no node-local Service (``internalTrafficPolicy: Local`` came in
1.21-1.26), so "their node's tier" is the socket; without one (no tier pod on
that node yet) an engine uses the Service, which may reach another node's tier:
all of them read through the same Redis, so every tier pod serves every engine.

The disk tier of a per-node pod is an ``emptyDir`` (sized ``spec.disk.size``) on
the node: a DaemonSet has no volume claims.
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]

LOCAL_SOCKET_DIR = "/run/kvtier"  # in the tier's and the engines' pods
LOCAL_SOCKET = f"{LOCAL_SOCKET_DIR}/tier.sock"
HOST_SOCKET_ROOT = "/var/run/kvtier"  # on the node: <root>/<namespace>/<tier>
SOCKET_VOLUME = "kvtier-socket"
SOCKET_DIR_MODE = 0o750
# Runs as root with only CHOWN and FOWNER: gives the kubelet-made directory to the tier's
# user (the tier image has Python; a shell is not needed).
_PREPARE = "import os; d = {dir!r}; os.chown(d, {uid}, {uid}); os.chmod(d, {mode})"


def host_socket_dir(namespace: str, tier: str) -> str:
    """The node's directory of a tier's socket: one per tier, so tiers never share one."""
    return f"{HOST_SOCKET_ROOT}/{namespace}/{tier}"


def socket_volume(namespace: str, tier: str) -> Obj:
    return {
        "name": SOCKET_VOLUME,
        "hostPath": {"path": host_socket_dir(namespace, tier), "type": "DirectoryOrCreate"},
    }


def socket_mount() -> Obj:
    return {"name": SOCKET_VOLUME, "mountPath": LOCAL_SOCKET_DIR}


def prepare_socket_dir(image: str, uid: int) -> Obj:
    """The init container that makes the socket directory the tier user's."""
    return {
        "name": "socket-dir",
        "image": image,
        "command": [
            "python3", "-c",
            _PREPARE.format(dir=LOCAL_SOCKET_DIR, uid=uid, mode=oct(SOCKET_DIR_MODE)),
        ],
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
        "volumeMounts": [socket_mount()],
    }  # fmt: skip


def daemonset_spec(selector: Obj, template: Obj) -> Obj:
    """One tier pod per node the template's nodeSelector and tolerations admit."""
    return {
        "selector": {"matchLabels": selector},
        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
        "template": template,
    }


def disk_volume(size: int | str) -> Obj:
    """The disk tier of a per-node pod: node-local scratch space of ``spec.disk.size``."""
    return {"name": "data", "emptyDir": {"sizeLimit": str(size)}}
