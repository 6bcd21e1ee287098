"""The encoder-cache connector's settings: the KV connector's, read from ``ec_connector_extra_config``.

One dict configures both connectors (the operator passes the same keys to both):
``ConnectorConfig`` parses it, so keys only the KV side uses are accepted, and
errors name the EC config's field. This module does not import vLLM.
"""

from __future__ import annotations

from typing import Any

from kvtier.connector.config import ConnectorConfig
from kvtier.connector.ec_keys import EncoderKeySpec, processor_fingerprint
from kvtier.connector.errors import ConfigError


def parse_config(extra: dict[str, Any] | None) -> ConnectorConfig:
    """``ec_connector_extra_config`` read as the KV connector's ``ConnectorConfig``;
    errors name the EC config's keys."""
    try:
        return ConnectorConfig.from_extra_config(extra)
    except ConfigError as exc:
        message = str(exc).replace("kv_connector_extra_config", "ec_connector_extra_config")
        raise ConfigError(message) from exc


def key_spec(config: ConnectorConfig, vllm_config: Any) -> EncoderKeySpec:
    """What makes this engine's encoder outputs meaningful (pinned in every key)."""
    model = vllm_config.model_config
    mm_config = getattr(model, "multimodal_config", None)
    processor_kwargs = getattr(mm_config, "mm_processor_kwargs", None)
    return EncoderKeySpec(
        model_id=config.model_id or model.model,
        model_revision=model.revision or "",
        encoder_dtype=str(model.dtype).removeprefix("torch."),
        processor=processor_fingerprint(processor_kwargs, model.model),
        hash_algo=config.hash_algo,
    )
