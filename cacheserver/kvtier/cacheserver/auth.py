"""Authentication: bearer tokens mapped to tenants.

Clients send ``authorization: Bearer <token>`` metadata. The token table comes
from ``--auth-tokens PATH``:

- a directory (a Kubernetes Secret mounted as a volume): one file per tenant,
  the file name is the tenant, its content the token;
- a file: one ``tenant token`` pair per line (``#`` starts a comment).

Tokens are compared in constant time against every configured token, so the
time to reject a token says nothing about which tenant's token it resembles.
The table is re-read when the path's modification time changes (a rotated
Secret), at most every ``reload_interval_s``.

Without ``--auth-tokens`` every caller is the ``default`` tenant.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.cacheserver.errors import SettingsError, Unauthenticated
from kvtier.cacheserver.namespace import MAX_TENANT_BYTES

logger = logging.getLogger(__name__)

TENANT_RE = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_TENANT_BYTES - 1}}}$")
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class _Entry:
    tenant: str
    token: bytes


def load_tokens(path: Path) -> list[_Entry]:
    """Reads a token table; raises SettingsError naming the path and the bad entry."""
    pairs: list[tuple[str, str, str]] = []  # (tenant, token, where)
    if path.is_dir():
        for f in sorted(path.iterdir()):
            if f.name.startswith(".") or not f.is_file():
                continue  # Secret volumes hold ..data links and dot-dirs
            pairs.append((f.name, f.read_text().strip(), str(f)))
    elif path.is_file():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise SettingsError(f"--auth-tokens {path}:{n}: expected 'tenant token', got {len(parts)} words")
            pairs.append((parts[0], parts[1], f"{path}:{n}"))
    else:
        raise SettingsError(f"--auth-tokens {path}: no such file or directory")
    entries: list[_Entry] = []
    seen: set[str] = set()
    for tenant, token, where in pairs:
        if not TENANT_RE.match(tenant):
            raise SettingsError(
                f"--auth-tokens {where}: tenant {tenant!r} must be 1..{MAX_TENANT_BYTES} characters "
                "of letters, digits, '.', '_' and '-'"
            )
        if len(token) < MIN_TOKEN_CHARS:
            raise SettingsError(
                f"--auth-tokens {where}: the token of tenant {tenant!r} is shorter than "
                f"{MIN_TOKEN_CHARS} characters (use e.g. `openssl rand -hex 24`)"
            )
        if token in seen:
            raise SettingsError(f"--auth-tokens {where}: tenant {tenant!r} reuses another tenant's token")
        seen.add(token)
        entries.append(_Entry(tenant, token.encode()))
    if not entries:
        raise SettingsError(f"--auth-tokens {path}: no tokens found")
    return entries


class TokenAuth:
    """Maps a call's bearer token to its tenant."""

    def __init__(self, path: Path, *, reload_interval_s: float = 5.0) -> None:
        self.path = path
        self.reload_interval_s = reload_interval_s
        self._entries = load_tokens(path)
        self._mtime = self._stamp()
        self._checked = time.monotonic()

    @property
    def tenants(self) -> list[str]:
        return [e.tenant for e in self._entries]

    def _stamp(self) -> float:
        try:
            if self.path.is_dir():
                return max([self.path.stat().st_mtime, *(f.stat().st_mtime for f in self.path.iterdir())])
            return self.path.stat().st_mtime
        except OSError:
            return 0.0

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.reload_interval_s:
            return
        self._checked = now
        stamp = self._stamp()
        if stamp == self._mtime:
            return
        try:
            self._entries = load_tokens(self.path)
        except (SettingsError, OSError) as exc:
            logger.error("auth tokens not reloaded, keeping the previous table: %s", exc)
            return
        self._mtime = stamp
        logger.info("auth tokens reloaded: %d tenants", len(self._entries))

    def tenant(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
        """The tenant of a call's metadata (its ``authorization`` entry); raises Unauthenticated."""
        for key, value in metadata or ():
            if key == "authorization":
                return self.authenticate(value.decode() if isinstance(value, bytes) else value)
        return self.authenticate(None)

    def authenticate(self, authorization: str | None) -> str:
        """The tenant of an authorization value (``Bearer <token>``); raises Unauthenticated."""
        self._maybe_reload()
        if authorization is None:
            raise Unauthenticated("missing 'authorization: Bearer <token>' metadata")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
        presented = token.strip().encode()
        found: str | None = None
        for entry in self._entries:  # every entry, always: constant time in the table
            if hmac.compare_digest(entry.token, presented):
                found = entry.tenant
        if found is None:
            raise Unauthenticated("unknown token")
        return found

