"""Fixtures for the cache server's tests: real ``redis-server`` processes (``tests/redisprocs.py``).

Each fixture starts its own processes under the test's ``tmp_path`` and stops
them by PID afterwards, also when a test left them paused (SIGSTOP) or killed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.testing.redisprocs import RedisClusterProcs, RedisServer, TlsFiles


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server on 127.0.0.1 (``.url``), also reachable on a unix socket (``.unix_url``)."""
    server = RedisServer.start(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def redis_unix(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server that listens only on a unix socket (``.unix_url``)."""
    server = RedisServer.start(tmp_path / "redis-unix", tcp=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A throwaway CA with a server and a client certificate, made once per session."""
    return TlsFiles.generate(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def redis_tls(tmp_path: Path, tls_files: TlsFiles) -> Iterator[RedisServer]:
    """A redis-server that speaks only TLS (``.tls_url``); client certificates are optional."""
    server = RedisServer.start(tmp_path / "redis-tls", tcp=False, tls=tls_files)
    yield server
    server.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterProcs]:
    """A 6-process Redis Cluster (3 primaries, 1 replica each); ``.url`` is redis+cluster://."""
    cluster = RedisClusterProcs.start(tmp_path / "cluster")
    yield cluster
    cluster.stop()
