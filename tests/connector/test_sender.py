"""The background sender on a real tier: ``flush`` returns only once every save offered
before it is stored, even while other saves keep arriving (tests and shutdown rely on it)."""

from __future__ import annotations

import threading

from kvtier.connector.client import TierClient
from kvtier.connector.client.breaker import CircuitBreaker
from kvtier.connector.metrics import Recorder
from kvtier.connector.sender import SaveSender
from kvtier.testing.tierproc import TierProcess


def sender_for(client: TierClient, recorder: Recorder) -> SaveSender:
    breaker = CircuitBreaker(failures=3, cooldown_s=1.0)
    return SaveSender(
        client, capacity=4096, batch=2, timeout_s=10.0, breaker=breaker, recorder=recorder
    )


def test_flush_waits_for_every_save_offered_before_it(tier: TierProcess) -> None:
    recorder = Recorder()
    with TierClient(tier.target) as client:
        sender = sender_for(client, recorder)
        stop = threading.Event()

        def noise() -> None:  # keeps the sender finishing batches as saves arrive
            n = 0
            while not stop.is_set():
                sender.offer(b"noise-%d" % n, [b"x" * 4096], 4096)
                n += 1
                stop.wait(0.002)

        thread = threading.Thread(target=noise)
        thread.start()
        try:
            for i in range(200):
                key = b"save-%d" % i
                assert sender.offer(key, [b"v" * 8192], 8192)
                assert sender.flush(10.0)
                assert client.lookup([key]) == 1, f"flush returned before {key!r} was stored"
        finally:
            stop.set()
            thread.join()
            sender.close()


def test_flush_of_an_idle_sender_returns_at_once_and_a_dead_tier_never_hangs_it(
    tier: TierProcess,
) -> None:
    recorder = Recorder()
    with TierClient(tier.target) as client:
        sender = sender_for(client, recorder)
        assert sender.flush(0.0)
        tier.stop()
        assert sender.offer(b"lost", [b"v" * 100], 100)
        assert sender.flush(30.0)  # the Put failed: counted as dropped, not pending forever
        sender.close()
    assert recorder.total("saves_dropped", label="tier_down") == 1
