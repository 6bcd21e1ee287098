"""Moved to kvtier.connector.chunks.codec; this path stays importable for routers and tools."""

from kvtier.connector.chunks.codec import *  # noqa: F403
