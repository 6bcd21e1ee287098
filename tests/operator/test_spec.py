from __future__ import annotations

import re
from typing import Any

import pytest

from kvtier.operator.errors import SpecError
from kvtier.operator.spec import (
    SecretKeyRef,
    Tls,
    parse_cache_tier,
    parse_model_recipe,
)
from tests.operator.bodies import cache_tier, model_recipe


def raw_recipe(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "ModelRecipe",
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "u1", "generation": 3},
        "spec": spec,
    }


MINIMAL = {
    "model": {"repo": "Qwen/Qwen2-0.5B", "architecture": "Qwen2ForCausalLM"},
    "engine": {"image": "vllm:1"},
    "tier": {"inline": {}},
}


def test_a_minimal_recipe_parses_the_same_with_or_without_the_crd_defaults() -> None:
    spec = {**MINIMAL, "tier": {"ref": {"name": "shared"}}}
    without = parse_model_recipe(raw_recipe(**spec))
    with_crd_defaults = parse_model_recipe(model_recipe(name="qwen", **spec) | {
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "u1", "generation": 3}
    })  # fmt: skip
    assert without == with_crd_defaults


def test_a_minimal_cache_tier_parses_the_same_with_or_without_the_crd_defaults() -> None:
    body = cache_tier()
    raw = {**body, "spec": {}}
    assert parse_cache_tier(raw) == parse_cache_tier(body)


def test_defaults_are_a_text_model_on_one_gpu_with_256_token_chunks() -> None:
    recipe = parse_model_recipe(raw_recipe(**MINIMAL))
    assert recipe.model.revision == "main"
    assert recipe.model.modalities == ("text",)
    assert (recipe.engine.kind, recipe.engine.replicas, recipe.engine.gpus) == ("vllm", 1, 1)
    assert (recipe.cache.chunk_size, recipe.cache.codec, recipe.cache.salt_policy) == (
        256, "raw", "request",
    )  # fmt: skip
    assert recipe.cache.encoder_cache is False


def test_an_unsupported_engine_is_rejected_naming_the_field_and_the_choices() -> None:
    spec = {**MINIMAL, "engine": {"image": "x", "kind": "sglang"}}
    with pytest.raises(
        SpecError, match=r"spec.engine.kind: engine 'sglang' is not supported.*vllm"
    ):
        parse_model_recipe(raw_recipe(**spec))


def test_the_encoder_cache_on_a_text_only_model_is_an_invalid_combination() -> None:
    spec = {**MINIMAL, "cache": {"encoderCache": True}}
    with pytest.raises(SpecError, match=r"spec\.cache\.encoderCache: .*multimodal"):
        parse_model_recipe(raw_recipe(**spec))


def test_gpus_in_engine_resources_are_rejected_in_favour_of_engine_gpus() -> None:
    spec = {**MINIMAL, "engine": {"image": "x", "resources": {"limits": {"nvidia.com/gpu": 2}}}}
    with pytest.raises(
        SpecError, match=re.escape("spec.engine.resources: set GPUs with spec.engine.gpus")
    ):
        parse_model_recipe(raw_recipe(**spec))


@pytest.mark.parametrize("tier", [{}, {"ref": {"name": "a"}, "inline": {}}])
def test_a_tier_needs_exactly_one_of_ref_and_inline(tier: dict[str, Any]) -> None:
    with pytest.raises(SpecError, match=re.escape("spec.tier: set exactly one of ref")):
        parse_model_recipe(raw_recipe(**{**MINIMAL, "tier": tier}))


def test_an_inline_tier_is_named_after_the_recipe_and_kept_as_written() -> None:
    spec = {**MINIMAL, "tier": {"inline": {"ramBytes": "8Gi"}}}
    recipe = parse_model_recipe(raw_recipe(**spec))
    assert recipe.tier_name == "qwen-tier"
    assert recipe.inline_tier == {"ramBytes": "8Gi"}


def test_an_invalid_inline_tier_is_reported_with_its_path() -> None:
    spec = {**MINIMAL, "tier": {"inline": {"ramBytes": "8GB"}}}
    with pytest.raises(
        SpecError, match=re.escape("spec.tier.inline.ramBytes: expected a quantity")
    ):
        parse_model_recipe(raw_recipe(**spec))


def test_a_referenced_tier_keeps_its_name() -> None:
    recipe = parse_model_recipe(model_recipe(tier={"ref": {"name": "shared"}}))
    assert recipe.tier_name == "shared"
    assert recipe.inline_tier is None


def test_the_owner_carries_the_generation_for_observed_generation() -> None:
    assert parse_model_recipe(raw_recipe(**MINIMAL)).owner.generation == 3


def test_tier_quantities_become_bytes() -> None:
    tier = parse_cache_tier(cache_tier(ramBytes="4Gi", disk={"size": "100Gi"}))
    assert tier.spec.ram_bytes == 4 * 2**30
    assert tier.spec.disk.size_bytes == 100 * 2**30
    assert tier.spec.disk.size == "100Gi"


def test_ram_recycle_bytes_is_a_quantity_zero_or_unset() -> None:
    assert parse_cache_tier(cache_tier()).spec.ram_recycle_bytes is None  # the server's default
    assert parse_cache_tier(cache_tier(ramRecycleBytes="512Mi")).spec.ram_recycle_bytes == 512 << 20
    assert parse_cache_tier(cache_tier(ramRecycleBytes=0)).spec.ram_recycle_bytes == 0
    with pytest.raises(SpecError, match=re.escape("spec.ramRecycleBytes: expected a quantity")):
        parse_cache_tier(cache_tier(ramRecycleBytes="lots"))


def test_secret_references_default_their_keys_and_name_their_fields() -> None:
    tier = parse_cache_tier(cache_tier(
        redis={"url": "redis://r:6379", "passwordSecretRef": {"name": "redis"}},
        authSecretRef={"name": "auth"},
    ))  # fmt: skip
    assert tier.spec.secret_refs() == [
        ("spec.redis.passwordSecretRef", SecretKeyRef("redis", "password")),
    ]
    assert tier.spec.auth_secret == "auth"  # the whole Secret: one key per tenant


def test_a_tenant_that_the_tier_could_not_accept_is_rejected_naming_the_field() -> None:
    body = model_recipe(cache={"tenant": "-team"})
    with pytest.raises(SpecError, match=r"spec.cache.tenant: '-team' is not a tenant name"):
        parse_model_recipe(body)


def test_a_redis_url_without_a_redis_scheme_is_rejected() -> None:
    with pytest.raises(SpecError, match=r"spec.redis.url: expected a redis:// or rediss://"):
        parse_cache_tier(cache_tier(redis={"url": "http://r:6379"}))


def test_a_name_too_long_for_the_children_is_rejected() -> None:
    body = cache_tier(name="t" * 41)
    with pytest.raises(SpecError, match=re.escape("metadata.name: at most 40 characters")):
        parse_cache_tier(body)


def test_a_tls_secret_needs_its_certificate_key_and_ca() -> None:
    tier = parse_cache_tier(cache_tier(tls={"secretName": "tier-tls"}))
    assert tier.spec.tls == Tls("tier-tls", client_auth=False)
    assert tier.spec.secret_refs() == [
        ("spec.tls.secretName", SecretKeyRef("tier-tls", key))
        for key in ("tls.crt", "tls.key", "ca.crt")
    ]


def test_the_data_port_of_several_replicas_without_redis_cannot_be_forced_on() -> None:
    body = model_recipe(tier={"inline": {"replicas": 2, "dataPort": {"enabled": True}}})
    with pytest.raises(
        SpecError,
        match=r"spec.tier.inline.dataPort.enabled: with 2 replicas and no spec.tier.inline.redis",
    ):
        parse_model_recipe(body)
    assert parse_cache_tier(cache_tier(replicas=2)).spec.data_port is False  # unset: off
    redis = {"url": "redis://r:6379"}
    tier = parse_cache_tier(cache_tier(replicas=2, redis=redis, dataPort={"enabled": True}))
    assert tier.spec.data_port is True


def test_a_client_certificate_reference_names_its_secret() -> None:
    recipe = parse_model_recipe(model_recipe(cache={"clientCertSecretRef": {"name": "engine-tls"}}))
    assert recipe.cache.client_cert_secret == "engine-tls"
    with pytest.raises(SpecError, match=r"spec.cache.clientCertSecretRef.name: required"):
        parse_model_recipe(model_recipe(cache={"clientCertSecretRef": {}}))


VL = {**MINIMAL, "model": {"repo": "Qwen/Qwen2.5-VL-3B-Instruct",
      "architecture": "Qwen2_5_VLForConditionalGeneration", "modalities": ["text", "image"]}}  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        ["--no-enable-prefix-caching", "--mm-processor-cache-gb", "0"],
        ["--mm_processor_cache_gb=0", "--enable-prefix-caching=false"],
        ["--enable-prefix-caching", "--mm-processor-cache-gb=0.0", "--no-enable-prefix-caching"],
    ],
)
def test_a_multimodal_engine_with_both_vllm_caches_off_is_rejected_naming_the_flags(
    args: list[str],
) -> None:
    spec = {**VL, "engine": {"image": "x", "args": args}}
    with pytest.raises(SpecError, match=r"spec\.engine\.args: .*--mm-processor-cache-gb 0"):
        parse_model_recipe(raw_recipe(**spec))


@pytest.mark.parametrize(
    "args",
    [
        ["--no-enable-prefix-caching"],
        ["--mm-processor-cache-gb", "0"],
        ["--no-enable-prefix-caching", "--mm-processor-cache-gb", "0", "--enable-prefix-caching"],
        ["--no-enable-prefix-caching", "--mm-processor-cache-gb=0", "--mm-processor-cache-gb=2"],
    ],
)
def test_a_multimodal_engine_with_one_vllm_cache_on_or_a_text_model_is_accepted(
    args: list[str],
) -> None:
    assert parse_model_recipe(raw_recipe(**{**VL, "engine": {"image": "x", "args": args}}))
    both_off = ["--no-enable-prefix-caching", "--mm-processor-cache-gb", "0"]
    assert parse_model_recipe(raw_recipe(**{**MINIMAL, "engine": {"image": "x", "args": both_off}}))


def model(**fields: Any) -> dict[str, Any]:
    return {"repo": "google/gemma-3-4b-it", "architecture": "Gemma3ForConditionalGeneration",
            **fields}  # fmt: skip


def test_a_model_on_a_volume_names_its_claim_and_a_normalized_path_inside_it() -> None:
    recipe = parse_model_recipe(raw_recipe(**{
        **MINIMAL, "model": model(volume={"claimName": "weights", "path": "./gemma/3-4b/"}),
    }))  # fmt: skip
    assert recipe.model.volume is not None
    assert (recipe.model.volume.claim, recipe.model.volume.path) == ("weights", "gemma/3-4b")
    assert recipe.model.claims() == [("spec.model.volume.claimName", "weights")]
    root = parse_model_recipe(raw_recipe(**{**MINIMAL, "model": model(volume={"claimName": "w"})}))
    assert root.model.volume is not None and root.model.volume.path == ""


@pytest.mark.parametrize("path", ["/abs/gemma", "gemma/../../etc", "..", "a b"])
def test_a_volume_path_leaving_the_volume_is_rejected_naming_the_field(path: str) -> None:
    spec = {**MINIMAL, "model": model(volume={"claimName": "weights", "path": path})}
    with pytest.raises(SpecError, match=r"^spec\.model\.volume\.path: expected a directory"):
        parse_model_recipe(raw_recipe(**spec))


def test_a_hub_token_defaults_its_key_to_token() -> None:
    spec = {**MINIMAL, "model": model(tokenSecretRef={"name": "hf"})}
    assert parse_model_recipe(raw_recipe(**spec)).model.token == SecretKeyRef("hf", "token")


@pytest.mark.parametrize("field", ["tokenSecretRef", "cache"])
def test_a_hub_token_or_download_cache_with_a_volume_model_is_rejected(field: str) -> None:
    value = {"name": "hf"} if field == "tokenSecretRef" else {"size": "100Gi"}
    spec = {**MINIMAL, "model": model(volume={"claimName": "w"}, **{field: value})}
    with pytest.raises(SpecError, match=rf"^spec\.model\.{field}: the weights come from"):
        parse_model_recipe(raw_recipe(**spec))


def test_a_model_cache_is_an_existing_claim_or_a_size_for_the_operators_claim() -> None:
    def cache(**fields: Any) -> Any:
        return parse_model_recipe(raw_recipe(**{**MINIMAL, "model": model(cache=fields)})).model

    made = cache(size="200Gi", storageClassName="nfs").cache
    assert made is not None
    assert (made.claim, made.size, made.storage_class, made.access_mode) == (
        None, "200Gi", "nfs", "ReadWriteMany",
    )  # fmt: skip
    existing = cache(claimName="hf-cache")
    assert existing.claims() == [("spec.model.cache.claimName", "hf-cache")]
    for fields in ({}, {"claimName": "c", "size": "1Gi"}):
        with pytest.raises(SpecError, match=r"^spec\.model\.cache: set exactly one of"):
            cache(**fields)
    with pytest.raises(SpecError, match=r"^spec\.model\.cache\.claimName: storageClassName"):
        cache(claimName="c", storageClassName="nfs")
    with pytest.raises(SpecError, match=r"^spec\.model\.cache\.size: expected a quantity"):
        cache(size="lots")


def test_a_tenant_quota_is_a_quantity_and_zero_or_unset_is_none() -> None:
    assert parse_cache_tier(cache_tier(tenantQuotaBytes="512Mi")).spec.tenant_quota_bytes == 512 << 20
    assert parse_cache_tier(cache_tier(tenantQuotaBytes=0)).spec.tenant_quota_bytes == 0
    assert parse_cache_tier(cache_tier()).spec.tenant_quota_bytes == 0
    with pytest.raises(SpecError, match=r"^spec\.tenantQuotaBytes: expected a quantity"):
        parse_cache_tier(cache_tier(tenantQuotaBytes="lots"))


def test_a_per_node_tier_without_redis_is_refused_naming_the_topology() -> None:
    with pytest.raises(SpecError, match=r"^spec\.topology: a per-node tier needs spec\.redis"):
        parse_cache_tier(cache_tier(topology="perNode"))
    inline = {**MINIMAL, "tier": {"inline": {"topology": "perNode"}}}
    with pytest.raises(SpecError, match=r"^spec\.tier\.inline\.topology: "):
        parse_model_recipe(raw_recipe(**inline))
    redis = {"url": "redis://redis:6379/0"}
    tier = parse_cache_tier(cache_tier(topology="perNode", redis=redis)).spec
    assert tier.per_node and tier.topology == "perNode"
    assert not parse_cache_tier(cache_tier()).spec.per_node  # shared by default


def test_a_per_node_tier_refuses_a_storage_class_it_could_not_use() -> None:
    spec = {"topology": "perNode", "redis": {"url": "redis://r:6379"},
            "disk": {"storageClassName": "local-nvme"}}  # fmt: skip
    with pytest.raises(SpecError, match=r"^spec\.disk\.storageClassName: a per-node tier"):
        parse_cache_tier(cache_tier(**spec))


def test_node_selectors_and_tolerations_are_checked_naming_the_entry() -> None:
    tier = parse_cache_tier(cache_tier(
        nodeSelector={"pool": "gpu"}, tolerations=[{"key": "gpu", "operator": "Exists"}],
    )).spec  # fmt: skip
    assert (tier.node_selector, tier.tolerations) == ({"pool": "gpu"}, ({"key": "gpu", "operator": "Exists"},))
    with pytest.raises(SpecError, match=r"^spec\.nodeSelector\.pool: expected a string"):
        parse_cache_tier(cache_tier(nodeSelector={"pool": 1}))
    with pytest.raises(SpecError, match=r"^spec\.tolerations\[1\]\.effect: expected one of"):
        parse_cache_tier(cache_tier(tolerations=[{"key": "a"}, {"key": "b", "effect": "Never"}]))
