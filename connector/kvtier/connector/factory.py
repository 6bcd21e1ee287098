"""How both vLLM connectors reach the tier: one client factory, one warm-up.

Each half of each connector (scheduler or worker; KV cache or encoder cache) calls
``connect`` with the one ``ConnectorConfig`` and its metric series, and talks to
the tier through the ``TierLink`` it returns: a ``TierClient`` built from every
client setting of the config (target, local socket, token and token file, TLS files,
deadline, receive buffers), a ``CircuitBreaker`` in front of it that counts its openings, and
the half's ``Recorder``. ``TierLink.warm_up`` opens the connection at start (one
Lookup, so the first request does not pay for the connection and the pick of a
transport; the log says at once whether the tier is reachable), and
``TierLink.take_stats`` is what the half reports each engine step. This module
does not import vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvtier.connector.client import TierClient
from kvtier.connector.client.breaker import BreakerState, CircuitBreaker
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.errors import TierError
from kvtier.connector.metrics import Recorder, Series, Stats

logger = logging.getLogger(__name__)

WARM_UP_TIMEOUT_S = 2.0
"""The warm-up Lookup's deadline, at most (``load_timeout_s`` when shorter)."""


@dataclass(frozen=True)
class TierLink:
    """One connector half's link to the tier."""

    client: TierClient
    breaker: CircuitBreaker
    recorder: Recorder

    def warm_up(self, config: ConnectorConfig, meanwhile: str) -> None:
        """Open the connection now (one Lookup). ``meanwhile``: what the engine does
        while the tier is unreachable, for the log ("requests recompute")."""
        try:
            self.client.lookup([bytes(32)], timeout_s=min(WARM_UP_TIMEOUT_S, config.load_timeout_s))
        except TierError as exc:
            logger.warning(
                "kvtier: tier %s not reachable at start (%s); %s until it is",
                config.target,
                exc,
                meanwhile,
            )
        else:
            logger.info("kvtier: tier %s reachable", config.target)

    def take_stats(self) -> Stats | None:
        """The interval's metrics, with the breaker's state as the ``breaker_open`` gauge:
        every call (every engine step) carries it, so the merged stats of a step hold
        the state of every half (the gauge is their max)."""
        self.recorder.set("breaker_open", int(self.breaker.state is not BreakerState.CLOSED))
        return self.recorder.take()

    def close(self) -> None:
        self.client.close()


def connect(config: ConnectorConfig, series: Series) -> TierLink:
    """The client, breaker and recorder of one connector half (no call is made yet)."""
    recorder = Recorder(series)
    breaker = CircuitBreaker(
        config.breaker_failures,
        config.breaker_cooldown_s,
        on_open=lambda: recorder.count("breaker_opened"),
    )
    client = TierClient(
        config.target,
        timeout_s=config.load_timeout_s,
        token=config.token,
        token_file=config.auth_token_file,
        tls_ca_file=config.tls_ca_file,
        tls_cert_file=config.tls_cert_file,
        tls_key_file=config.tls_key_file,
        receive_buffer_bytes=config.receive_buffer_bytes,
        local_socket=config.local_socket,
    )
    return TierLink(client, breaker, recorder)
