"""Tenant namespaces: every key a client sends is stored under its tenant.

The tenant comes from the caller's authenticated identity (``default`` until
authentication is configured), never from the request, so two tenants sending
the same key address two different entries. The scoped key is length-prefixed
(one byte of tenant length), so no (tenant, key) pair can be mistaken for
another.
"""

from __future__ import annotations

DEFAULT_TENANT = "default"
MAX_TENANT_BYTES = 255


def scoped(tenant: str, key: bytes) -> bytes:
    """The storage key of ``key`` in ``tenant``'s namespace."""
    t = tenant.encode()
    if not 0 < len(t) <= MAX_TENANT_BYTES:
        raise ValueError(f"tenant name must be 1..{MAX_TENANT_BYTES} bytes")
    return bytes((len(t),)) + t + key


def tenant_of(scoped_key: bytes) -> str:
    return scoped_key[1 : 1 + scoped_key[0]].decode()
