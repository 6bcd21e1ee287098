"""The Redis tier behind a write-through tier fails while real vLLM engines use it:
killed, frozen (SIGSTOP), restarted empty. Every request completes with the output of a
no-cache run, saves go on (a Put waits for Redis at most ``--tier-timeout``), and the
Redis tier comes back by itself.

The tier has 1 MiB of RAM and no disk, writes through to Redis (a Put returns once
Redis holds the value, or once Redis is known to be failing), and the engines reach it
over its data port. A prompt's chunks pushed out of RAM by three later prompts live only
in Redis: engine R's hits on them prove the Redis path, and its misses while Redis is
down prove the fault is contained. Engine W computes every prompt first (its output is
the no-cache reference) and saves it. (Redis faults under the default write-behind
policy: tests/cacheserver/test_server_redis.py, on a real tier without vLLM.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.testing.engine import EngineProcess
from kvtier.testing.redisprocs import RedisServer
from kvtier.testing.tierproc import TierProcess
from kvtier.testing.tinymodels import prompt_text
from tests.e2e.conftest import FAST_FAULTS, RELAXED
from tests.e2e.faultreport import record

pytestmark = pytest.mark.vllm

CHUNK = 256
PROMPT_WORDS = 330  # 3 full chunks


@pytest.fixture(scope="module")
def redis(module_dir: Path) -> Iterator[RedisServer]:
    server = RedisServer.start(module_dir / "redis")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_tier(module_dir: Path, redis: RedisServer) -> Iterator[TierProcess]:
    tier = TierProcess.start(
        module_dir / "tier",
        "--redis-url", redis.url,
        "--ram-bytes", "1MiB",
        "--disk-bytes", "0",
        "--write-policy", "write-through",
    )  # fmt: skip
    yield tier
    tier.stop()


@pytest.fixture(scope="module")
def engines(
    text_model: Path, redis_tier: TierProcess, start_engine: Callable[..., EngineProcess]
) -> tuple[EngineProcess, EngineProcess]:
    w = start_engine(
        text_model, name="w", extra_config={"target": redis_tier.target, **RELAXED}, wait=False
    )
    r = start_engine(
        text_model, name="r", extra_config={"target": redis_tier.target, **FAST_FAULTS},
        wait=False,
    )  # fmt: skip
    w.wait_ready()
    r.wait_ready()
    return w, r


def _dbsize(redis: RedisServer) -> int:
    return int(redis.cli("DBSIZE").strip())


def _redis_errors(tier: TierProcess) -> float:
    """kvtier_tier_errors_total{tier="redis"}, summed over every op."""
    return sum(
        float(line.rpartition(" ")[2])
        for line in tier.metrics().splitlines()
        if line.startswith("kvtier_tier_errors_total{") and 'tier="redis"' in line
    )


def _wait_redis_holds(redis: RedisServer, keys: int) -> None:
    deadline = time.monotonic() + 30
    while _dbsize(redis) < keys:
        assert time.monotonic() < deadline, "the tier's write-behind never reached Redis"
        time.sleep(0.1)


def only_in_redis(
    writer: EngineProcess, redis: RedisServer, seed: int
) -> tuple[dict[str, str], list[int]]:
    """A prompt computed and saved by W whose chunks the tier's RAM has since dropped."""
    held = _dbsize(redis)
    prompt = {"prompt": prompt_text(PROMPT_WORDS, seed=seed)}
    (out,) = writer.generate([prompt])
    assert out.num_cached_tokens == 0
    for filler in range(3):  # 9 more chunks of 128 KiB: more than the 1 MiB of RAM holds
        writer.generate([{"prompt": prompt_text(PROMPT_WORDS, seed=seed * 10 + filler)}])
    writer.flush()
    _wait_redis_holds(redis, held + 12)  # the prompt's 3 chunks and the fillers' 9
    return prompt, out.token_ids


def _wait_healthy(tier: TierProcess) -> None:
    deadline = time.monotonic() + 30
    while tier.metric("kvtier_tier_healthy", tier="redis") != 1:
        assert time.monotonic() < deadline, "the Redis tier did not come back"
        time.sleep(0.2)


def test_chunks_only_redis_holds_are_served_to_another_engine(
    engines: tuple[EngineProcess, EngineProcess], redis: RedisServer, redis_tier: TierProcess
) -> None:
    writer, reader = engines
    prompt, expected = only_in_redis(writer, redis, seed=1)
    before = redis_tier.metric("kvtier_tier_hits_total", tier="redis")

    (out,) = reader.generate([prompt])

    assert out.token_ids == expected
    assert out.num_cached_tokens == 3 * CHUNK
    assert redis_tier.metric("kvtier_tier_hits_total", tier="redis") - before >= 3


def test_redis_killed_costs_misses_not_requests_and_a_restarted_redis_is_used_again(
    engines: tuple[EngineProcess, EngineProcess], redis: RedisServer, redis_tier: TierProcess
) -> None:
    writer, reader = engines
    prompt, expected = only_in_redis(writer, redis, seed=2)
    fresh_prompt = {"prompt": prompt_text(PROMPT_WORDS, seed=3)}
    errors_before = _redis_errors(redis_tier)
    saved_before = writer.stats().get("saved_chunks", 0)
    redis.kill()
    try:
        started = time.monotonic()
        outs = reader.generate([prompt, prompt])
        elapsed = time.monotonic() - started
        (fresh,) = writer.generate([fresh_prompt])  # saves go on: RAM takes them
        writer.flush()
    finally:
        redis.restart()  # back on the same port, empty

    assert [o.token_ids for o in outs] == [expected, expected]
    assert outs[0].num_cached_tokens == 0  # only Redis had it
    assert fresh.num_cached_tokens == 0 and fresh.token_ids
    assert writer.stats().get("saved_chunks", 0) - saved_before == 3
    assert _redis_errors(redis_tier) > errors_before  # the tier saw Redis fail and went on
    assert redis_tier.proc is not None and redis_tier.proc.poll() is None
    bound = 2 * FAST_FAULTS["lookup_timeout_s"] + 10
    assert elapsed < bound
    record("Redis SIGKILLed (write-through tier)", "data port", [o.token_ids for o in outs],
           [expected, expected], elapsed, bound)  # fmt: skip

    _wait_healthy(redis_tier)
    again, again_expected = only_in_redis(writer, redis, seed=4)
    hits = redis_tier.metric("kvtier_tier_hits_total", tier="redis")
    (out,) = reader.generate([again])
    assert out.token_ids == again_expected
    assert out.num_cached_tokens == 3 * CHUNK
    # Read from the restarted Redis (num_cached_tokens alone is the Lookup's count).
    assert redis_tier.metric("kvtier_tier_hits_total", tier="redis") - hits >= 3


def test_redis_frozen_costs_misses_and_holds_saves_at_most_the_tier_timeout(
    engines: tuple[EngineProcess, EngineProcess], redis: RedisServer, redis_tier: TierProcess
) -> None:
    writer, reader = engines
    _wait_healthy(redis_tier)
    prompt, expected = only_in_redis(writer, redis, seed=5)
    fresh_prompt = {"prompt": prompt_text(PROMPT_WORDS, seed=7)}
    saved_before = writer.stats()
    redis.pause()
    try:
        started = time.monotonic()
        outs = reader.generate([prompt, prompt])
        elapsed = time.monotonic() - started
        # A write-through Put waits for the frozen Redis until --tier-timeout (1 s), then
        # Redis is marked failing and the value is stored in RAM: the save is not lost.
        (fresh,) = writer.generate([fresh_prompt])
        writer.flush()
        saving = time.monotonic() - started - elapsed
    finally:
        redis.resume()

    assert [o.token_ids for o in outs] == [expected, expected]
    assert outs[0].num_cached_tokens == 0
    # nothing waits past the connector's lookup deadline per request
    bound = 2 * FAST_FAULTS["lookup_timeout_s"] + 10
    assert elapsed < bound
    assert fresh.num_cached_tokens == 0 and fresh.token_ids
    saved = writer.stats()
    assert saved.get("saved_chunks", 0) - saved_before.get("saved_chunks", 0) == 3
    assert saved.get("saves_dropped:tier_down", 0) == saved_before.get("saves_dropped:tier_down", 0)
    assert saving < RELAXED["save_timeout_s"]
    record("Redis SIGSTOPped (write-through tier)", "data port", [o.token_ids for o in outs],
           [expected, expected], elapsed, bound)  # fmt: skip
    _wait_healthy(redis_tier)
    (out,) = reader.generate([{"prompt": prompt_text(PROMPT_WORDS, seed=6)}])
    assert out.token_ids  # served (computed) after the thaw
