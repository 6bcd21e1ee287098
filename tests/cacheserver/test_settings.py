"""``kvtier server`` settings: every flag has an env var, values are validated with clear messages."""

from __future__ import annotations

import pytest

from kvtier.cacheserver import settings
from kvtier.cacheserver.errors import SettingsError


def parse(*argv: str, **env: str) -> settings.Settings:
    return settings.parse(list(argv), env=env)


def test_durations_take_hours_and_minutes() -> None:
    s = parse("--redis-ttl", "24h", "--tier-timeout", "1.5", "--grace-period", "2m", "--redis-timeout", "250ms")
    assert (s.redis_ttl_s, s.tier_timeout_s, s.grace_period_s, s.redis_timeout_s) == (86400, 1.5, 120, 0.25)


def test_every_flag_is_also_read_from_its_env_var() -> None:
    for flag in settings._FLAGS:
        assert flag.env == "KVTIER_" + flag.name.upper().replace("-", "_")
    s = parse(KVTIER_RAM_BYTES="1GiB", KVTIER_RAM_RECYCLE_BYTES="0", KVTIER_REDIS_TTL="1h")
    assert (s.ram_bytes, s.ram_recycle_bytes, s.redis_ttl_s) == (1 << 30, 0, 3600)


def test_a_flag_wins_over_its_env_var() -> None:
    assert parse("--ram-bytes", "1MiB", KVTIER_RAM_BYTES="1GiB").ram_bytes == 1 << 20


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--redis-ttl", "500ms"), "--redis-ttl (env KVTIER_REDIS_TTL): must be 0 (no expiry) or a whole number"),
        (("--redis-ttl", "1.5"), "--redis-ttl (env KVTIER_REDIS_TTL): must be 0 (no expiry) or a whole number"),
        (("--write-behind-bytes", "0"), "--write-behind-bytes (env KVTIER_WRITE_BEHIND_BYTES): must be greater than 0"),
        (("--ram-recycle-bytes", "-1"), "--ram-recycle-bytes='-1' is invalid: expected a size such as 256MiB, or 0"),
        (("--ram-bytes", "0"), "--ram-bytes (env KVTIER_RAM_BYTES): must be greater than 0"),
        (("--port", "70000"), "--port='70000' is invalid: expected a port number 0..65535"),
        (("--max-key-bytes", "2048"), "--max-key-bytes (env KVTIER_MAX_KEY_BYTES): must be at most 1024"),
        (
            ("--incoming-bytes", "64MiB"),
            "--incoming-bytes (env KVTIER_INCOMING_BYTES): 64MiB is less than --max-value-bytes (256MiB)",
        ),
    ],
)
def test_a_bad_value_is_refused_naming_the_flag_its_env_var_and_what_it_accepts(
    argv: tuple[str, ...], message: str
) -> None:
    with pytest.raises(SettingsError) as err:
        parse(*argv)
    assert message in str(err.value)
