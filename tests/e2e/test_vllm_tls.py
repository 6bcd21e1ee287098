"""A vLLM engine configured as the operator configures it for a mutual-TLS tier.

The connector's ``tls_ca_file``, ``tls_cert_file`` and ``tls_key_file`` (what the
operator writes for a CacheTier with ``spec.tls.clientAuth``) reach the tier client
of a real engine: it saves to and loads from a tier that accepts nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.testing.engine import EngineProcess
from kvtier.testing.redisprocs import TlsFiles
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import prompt_text
from tests.e2e.conftest import RELAXED

pytestmark = pytest.mark.vllm

CHUNK = 256
PROMPT_WORDS = 330  # 3 full chunks of 256


def test_an_engine_with_the_operators_tls_keys_saves_to_and_loads_from_a_mutual_tls_tier(
    text_model: Path,
    start_engine: Callable[..., EngineProcess],
    start_tier: Callable[..., TierProcess],
    tmp_path: Path,
) -> None:
    files = TlsFiles.generate(tmp_path / "pki")
    tier = start_tier(
        "--tls-cert-file", str(files.server_cert), "--tls-key-file", str(files.server_key),
        "--tls-client-ca-file", str(files.ca),
    )  # fmt: skip
    config = {
        "target": tier.target,
        "chunk_size": CHUNK,
        "tls_ca_file": str(files.ca),
        "tls_cert_file": str(files.client_cert),
        "tls_key_file": str(files.client_key),
        **RELAXED,
    }
    engine = start_engine(text_model, name="tls", extra_config=config)
    prompt = {"prompt": prompt_text(PROMPT_WORDS, seed=40)}

    (first,) = engine.generate([prompt])
    engine.flush()
    (again,) = engine.generate([prompt])

    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 3 * CHUNK  # loaded back over TLS
    assert again.token_ids == first.token_ids
    assert engine.stats().get("errors:lookup", 0) == 0
