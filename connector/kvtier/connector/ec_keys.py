"""Moved to ``kvtier.connector.chunks.encoder_keys``; this path stays importable for tools."""

from kvtier.connector.chunks.encoder_keys import *  # noqa: F403
