"""The settings of both vLLM connectors, parsed once from vLLM's ``kv_connector_extra_config``
(the KV connector) or ``ec_connector_extra_config`` (the encoder-cache connector): one
``ConnectorConfig``, the same keys.

Every key is optional except ``target``; unknown keys and bad values raise
``ConfigError`` naming the key and what it accepts. The full table, with defaults,
is in docs/connector.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final

from kvtier.connector.chunks.codec import CODEC_IDS
from kvtier.connector.chunks.keys import HASH_ALGOS
from kvtier.connector.errors import ConfigError

SALT_POLICIES: Final = ("request", "none", "required")
"""``request``: a request's ``cache_salt`` (if any) goes into its keys; ``none``: salts are
ignored, every request shares one cache; ``required``: requests without a salt are
neither looked up nor saved (for tenants that must never share). The fixed ``salt`` of
the config goes into every key under every policy, and does not count as a request's
salt for ``required``."""

TOKEN_SOURCES: Final = ("token", "token_env", "auth_token_file")
TLS_FILES: Final = ("tls_ca_file", "tls_cert_file", "tls_key_file")

_PREFIX: Final = "kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorConfig:
    target: str
    """The tier's gRPC address, ``host:port``."""
    chunk_size: int = 256
    """Tokens per stored chunk; a multiple of the engine's KV block size."""
    token: str | None = field(default=None, repr=False)
    """Bearer token for the tier (or name an environment variable with ``token_env``)."""
    model_id: str | None = None
    """Model identity pinned in keys; default: the engine's ``--model`` (name or path)."""
    lookup_timeout_s: float = 1.0
    """Deadline of the scheduler's one ``Lookup`` per request (on the scheduling path)."""
    load_timeout_s: float = 5.0
    """Deadline of one request's chunk ``Get`` before its forward pass."""
    save_timeout_s: float = 10.0
    """Deadline of one background ``Put`` batch."""
    save_queue_chunks: int = 64
    """Chunks waiting for the background sender; more are dropped (and counted)."""
    save_batch_chunks: int = 8
    """Chunks sent per ``Put`` call."""
    breaker_failures: int = 3
    """Consecutive failed calls that open the circuit breaker."""
    breaker_cooldown_s: float = 5.0
    """Seconds an open breaker waits before letting one probe call through."""
    salt_policy: str = "request"
    """One of ``SALT_POLICIES``."""
    hash_algo: str = "sha256"
    """Key hash, one of ``kvtier.connector.chunks.keys.HASH_ALGOS``."""
    auth_token_file: str | None = None
    """A file holding the bearer token (a mounted Kubernetes Secret): read at start, and
    again when the tier answers UNAUTHENTICATED (a rotated Secret). ``token`` is what was
    read at start."""
    salt: str | None = None
    """A fixed salt hashed into every key next to the request's ``cache_salt`` (e.g. the
    namespace: engines with different salts never share entries)."""
    codec: str = "raw"
    """How chunk payloads are stored, one of ``kvtier.connector.chunks.codec.CODEC_IDS``."""
    tls_ca_file: str | None = None
    """Speak TLS to the tier, verifying its certificate with this CA bundle (PEM)."""
    tls_cert_file: str | None = None
    """A client certificate (PEM) for a tier that requires mutual TLS; with ``tls_key_file``."""
    tls_key_file: str | None = None
    """The private key (PEM) of ``tls_cert_file``."""
    receive_buffer_bytes: int = 256 << 20
    """Bytes of buffers of loaded chunks the worker keeps to receive later chunks of the
    same size into, instead of fresh memory (0: none)."""
    local_socket: str | None = None
    """The Unix socket of a tier on this node (``kvtier server --local-socket``), tried
    before ``target``: every call over it, chunks through shared memory. Where nothing
    answers on it, ``target`` is used and the socket tried again a minute later."""
    layerwise: bool = True
    """On a GPU: copy each layer's blocks as the forward reaches it (loads overlap the
    layers before, saves the layers after; vLLM then runs CUDA graphs piecewise). False:
    the forward waits for all loads before its first layer, saves are copied after it,
    and vLLM keeps full CUDA graphs. The CPU backend always copies whole steps."""

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or ":" not in self.target:
            raise ConfigError(f"{_PREFIX}.target must be 'host:port', got {self.target!r}")
        for name in ("chunk_size", "save_queue_chunks", "save_batch_chunks", "breaker_failures"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{_PREFIX}.{name} must be an int >= 1, got {value!r}")
        value = self.receive_buffer_bytes
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(
                f"{_PREFIX}.receive_buffer_bytes must be an int >= 0 (bytes; 0: off), got {value!r}"
            )
        for name in ("lookup_timeout_s", "load_timeout_s", "save_timeout_s", "breaker_cooldown_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(
                    f"{_PREFIX}.{name} must be a number of seconds > 0, got {value!r}"
                )
        if not isinstance(self.layerwise, bool):
            raise ConfigError(f"{_PREFIX}.layerwise must be true or false, got {self.layerwise!r}")
        if self.salt_policy not in SALT_POLICIES:
            raise ConfigError(
                f"{_PREFIX}.salt_policy must be one of {', '.join(SALT_POLICIES)}, "
                f"got {self.salt_policy!r}"
            )
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"{_PREFIX}.hash_algo must be one of {', '.join(HASH_ALGOS)}, got {self.hash_algo!r}"
            )
        if self.codec not in CODEC_IDS:
            raise ConfigError(
                f"{_PREFIX}.codec must be one of {', '.join(CODEC_IDS)}, got {self.codec!r}"
            )
        if self.codec == "zstd":
            try:
                import zstandard  # noqa: F401
            except ImportError as exc:
                raise ConfigError(
                    f"{_PREFIX}.codec 'zstd' needs the zstandard package "
                    "(pip install 'kvtier[connector]')"
                ) from exc
        for name in ("token", "model_id", "salt", "auth_token_file", "local_socket", *TLS_FILES):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{_PREFIX}.{name} must be a non-empty string, got {value!r}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError(
                f"{_PREFIX}: give both tls_cert_file and tls_key_file (a client certificate "
                "for mutual TLS), or neither"
            )
        for name in TLS_FILES:
            path = getattr(self, name)
            if path is not None and not os.access(path, os.R_OK):
                raise ConfigError(f"{_PREFIX}.{name}: cannot read {path!r}")
        if self.auth_token_file is not None and self.token is None:
            object.__setattr__(self, "token", read_token_file(self.auth_token_file))

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, *, name: str = _PREFIX
    ) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config`` (a JSON object). ``name``: the setting the
        errors name; the encoder-cache connector reads the same keys from
        ``ec_connector_extra_config`` (keys only the KV connector uses are accepted
        there and ignored, so the operator passes one dict to both)."""
        try:
            return cls._parse(extra)
        except ConfigError as exc:
            if name == _PREFIX:
                raise
            raise ConfigError(str(exc).replace(_PREFIX, name)) from exc

    @classmethod
    def _parse(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        values = dict(extra or {})
        accepted = {f.name for f in fields(cls)} | {"token_env"}
        given = [name for name in TOKEN_SOURCES if name in values]
        if len(given) > 1:
            raise ConfigError(
                f"{_PREFIX}: give one of {', '.join(TOKEN_SOURCES)} for the tier token, "
                f"not {' and '.join(given)}"
            )
        unknown = sorted(set(values) - accepted)
        if unknown:
            raise ConfigError(
                f"unknown {_PREFIX} key(s) {', '.join(map(repr, unknown))}; "
                f"accepted: {', '.join(sorted(accepted))}"
            )
        if "target" not in values:
            raise ConfigError(f"{_PREFIX}.target is required (the tier's 'host:port')")
        token_env = values.pop("token_env", None)
        if token_env is not None:
            if not isinstance(token_env, str) or not os.environ.get(token_env):
                raise ConfigError(
                    f"{_PREFIX}.token_env names an environment variable holding the tier "
                    f"token; {token_env!r} is not set"
                )
            values["token"] = os.environ[token_env]
        return cls(**values)

    def check_block_size(self, block_size: int) -> None:
        """``chunk_size`` must be a whole number of the engine's KV blocks."""
        if self.chunk_size % block_size:
            lower = max(block_size, self.chunk_size // block_size * block_size)
            raise ConfigError(
                f"{_PREFIX}.chunk_size={self.chunk_size} must be a multiple of the engine's "
                f"KV block size {block_size} (--block-size); use e.g. {lower} or "
                f"{lower + block_size}"
            )


def check_item_identifiers(vllm_config: Any, connector: str) -> None:
    """Refuse an engine whose multimodal items are named per request, not by content.

    kvtier keys an image (or audio clip) by vLLM's item identifier. vLLM hashes the
    item's content into that identifier unless both its prefix cache and its
    multimodal processor cache are off; then it names the item after the request
    (``renderer0-mm-7-image-0``, a counter that restarts with every process): the
    same image would never hit, and the first image of two engines would share a name
    (a wrong hit). Text-only models are not affected."""
    model = vllm_config.model_config
    mm_config = getattr(model, "multimodal_config", None)
    if mm_config is None or getattr(model, "is_encoder_decoder", False):
        return
    if mm_config.mm_processor_cache_gb == 0 and not vllm_config.cache_config.enable_prefix_caching:
        raise ConfigError(
            f"{connector} keys multimodal items by vLLM's item identifiers, and with both "
            "the prefix cache and the multimodal processor cache off (enable_prefix_caching="
            "False, mm_processor_cache_gb=0) vLLM names items per request instead of by "
            "content: the same image would never hit and different images could share a "
            "name. Set --mm-processor-cache-gb to a value > 0 (vLLM's default is 4) or "
            "enable the prefix cache (--enable-prefix-caching)"
        )


def read_token_file(path: str) -> str:
    """The bearer token in ``path`` (whitespace stripped); ``ConfigError`` naming
    ``auth_token_file`` when the file is missing, unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{_PREFIX}.auth_token_file: cannot read the tier token from {path!r}: {exc}"
        ) from exc
    if not token:
        raise ConfigError(f"{_PREFIX}.auth_token_file: {path!r} is empty (expected the tier token)")
    return token
