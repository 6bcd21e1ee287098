"""Moved to kvtier.connector.chunks.keys; this path stays importable for routers and tools."""

from kvtier.connector.chunks.keys import *  # noqa: F403
