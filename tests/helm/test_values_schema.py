"""values.schema.json: bad values stop `helm install` (and `helm template`) with a message naming the field."""

from __future__ import annotations

from pathlib import Path

from tests.helm.conftest import CHART, Helm


def lint_error(helm: Helm, tmp_path: Path, values: str) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(values)
    result = helm.run("template", "kvtier", CHART, "--values", path, check=False)
    assert result.returncode != 0, result.stdout
    return result.stdout + result.stderr


def test_an_unknown_key_fails_with_the_schemas_message_naming_it(helm: Helm, tmp_path: Path) -> None:
    message = lint_error(helm, tmp_path, "defaultTier:\n  ramBytez: 4Gi\n")
    assert "values don't meet the specifications of the schema" in message
    assert "at '/defaultTier': additional properties 'ramBytez' not allowed" in message


def test_an_unknown_top_level_key_fails(helm: Helm, tmp_path: Path) -> None:
    message = lint_error(helm, tmp_path, "operatr:\n  verbose: true\n")
    assert "additional properties 'operatr' not allowed" in message


def test_a_wrong_type_fails_with_the_schemas_message_naming_the_field(
    helm: Helm, tmp_path: Path
) -> None:
    message = lint_error(helm, tmp_path, "defaultTier:\n  replicas: two\n")
    assert "at '/defaultTier/replicas': got string, want integer" in message


def test_an_unknown_redis_mode_fails_listing_the_accepted_ones(helm: Helm, tmp_path: Path) -> None:
    message = lint_error(helm, tmp_path, "redis:\n  mode: cluster\n")
    assert "at '/redis/mode'" in message
    assert "'none', 'inChart', 'external'" in message


def test_external_redis_without_a_url_fails_saying_what_to_set(helm: Helm, tmp_path: Path) -> None:
    message = lint_error(helm, tmp_path, "redis:\n  mode: external\n")
    assert "redis.url is required when redis.mode is external" in message


def test_a_redis_url_with_another_scheme_fails(helm: Helm, tmp_path: Path) -> None:
    message = lint_error(helm, tmp_path, "redis:\n  mode: external\n  url: http://redis:6379\n")
    assert "at '/redis/url'" in message
