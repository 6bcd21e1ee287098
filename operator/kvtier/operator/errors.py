"""Errors of the kvtier operator.

The tree::

    OperatorError                 base of everything the operator raises on purpose
    ├── SpecError                 a custom resource asks for something invalid; names the field
    └── KubeError                 the API server answered with an error status
        ├── NotFound              404
        ├── Conflict              409: exists already, or a field manager conflict
        ├── Invalid               422: the object failed validation (e.g. an immutable field)
        └── ChildConflict         a child's name is taken by an object the parent does not own

``SpecError`` and ``ChildConflict`` become status conditions (the user fixes them);
other ``KubeError``\\ s are retried by kopf.
"""

from __future__ import annotations


class OperatorError(Exception):
    """Base class of the operator's errors."""


class SpecError(OperatorError):
    """A custom resource's spec is invalid; ``field`` is its dotted path (``spec.tier.ref``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class KubeError(OperatorError):
    """The API server refused a request."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class NotFound(KubeError):
    """404: the object does not exist."""


class Conflict(KubeError):
    """409: the object exists already, or another field manager owns a field."""


class Invalid(KubeError):
    """422: the object failed validation."""


class ChildConflict(OperatorError):
    """A child object's name is taken by an object that the parent does not control."""

    def __init__(self, kind: str, name: str) -> None:
        super().__init__(
            f"a {kind} named {name!r} exists and is not managed by this resource: "
            "rename or delete it"
        )
        self.kind = kind
        self.name = name
