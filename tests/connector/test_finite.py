"""NaN and infinities in a chunk to store: found by the C scan and by numpy alike, and the
chunk refused (codec), dropped and counted (worker), on real KV tensors and a real tier."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from kvtier.connector import factory, metrics, sender
from kvtier.connector.chunks import finite
from kvtier.connector.chunks.codec import decode_chunk, encode_chunk
from kvtier.connector.client.tierclient import TierClient
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.errors import NonFiniteChunk
from kvtier.connector.kv.layouts import KVContent, KVOrder
from kvtier.connector.kv.plan import ChunkLoad, ChunkSave, RequestLoad, StepPlan
from kvtier.connector.kv.worker import KvtierWorker
from kvtier.testing.tierproc import TierProcess

FLOATS = {name: getattr(torch, name) for name in finite.NONFINITE_BITS}
N = 3 * 4096 + 5  # three scan blocks of the C loop and a partial one
PLACES = [0, 1, 4095, 4096, 4097, 2 * 4096 + 17, N - 1]


def scans(payload: object, dtype: str) -> tuple[int, int]:
    """(the C scan, the numpy scan) of ``payload``."""
    assert finite._finite is not None, "scripts/setup builds kvtier.connector.chunks._finite"
    width, mask = finite.NONFINITE_BITS[dtype]
    return finite._finite.first_nonfinite(payload, width, mask), finite.first_nonfinite_py(payload, width, mask)


def tensor(dtype: str, n: int = N) -> torch.Tensor:
    return (torch.randn(n) * 8).to(FLOATS[dtype])


@pytest.mark.parametrize("dtype", sorted(FLOATS))
def test_finite_values_pass_both_scans_extremes_included(dtype: str) -> None:
    info = torch.finfo(FLOATS[dtype])
    x = tensor(dtype)
    x[:6] = torch.tensor([info.max, info.min, info.tiny, -info.tiny, -0.0, info.smallest_normal / 4])
    assert torch.isfinite(x.float()).all()
    assert scans(x.view(torch.uint8).numpy(), dtype) == (-1, -1)


NONFINITE = [
    pytest.param(dtype, bad, id=f"{dtype}-{bad}")
    for dtype in sorted(FLOATS)
    for bad in ("nan", "inf", "-inf")
    if not (dtype == "float8_e4m3fn" and bad != "nan")  # no infinity: torch stores 448
]


@pytest.mark.parametrize(("dtype", "bad"), NONFINITE)
def test_the_first_nan_or_infinity_is_found_wherever_it_is(dtype: str, bad: str) -> None:
    for place in PLACES:
        x = tensor(dtype)
        x[place] = float(bad)
        x[min(place + 3, N - 1)] = float(bad)
        assert not torch.isfinite(x[place].float())
        assert scans(x.view(torch.uint8).numpy(), dtype) == (place, place)
        assert finite.first_nonfinite(x.view(torch.uint8).numpy(), dtype) == place


@pytest.mark.parametrize("dtype", sorted(FLOATS))
def test_a_payload_at_any_alignment_is_scanned_alike(dtype: str) -> None:
    """A decoded chunk's payload starts right after its header, whose length can be odd."""
    for place in (-1, 0, 4096, N - 1):
        x = tensor(dtype)
        if place >= 0:
            x[place] = float("nan")
        raw = x.view(torch.uint8).numpy().tobytes()
        for skew in range(1, 4):
            moved = memoryview(bytearray(skew) + raw)[skew:]
            assert scans(moved, dtype) == (place, place), skew


def test_integer_dtypes_are_never_scanned() -> None:
    assert finite.first_nonfinite(b"\xff" * 64, "int8") == finite.first_nonfinite(b"\xff" * 64, "uint8") == -1


def test_a_payload_of_part_of_an_element_or_a_bad_mask_is_refused_by_name() -> None:
    assert finite._finite is not None
    with pytest.raises(ValueError, match="3 bytes is not a whole number of 2-byte elements"):
        finite.first_nonfinite(b"abc", "bfloat16")
    with pytest.raises(ValueError, match="3 bytes is not a whole number of 2-byte elements"):
        finite.first_nonfinite_py(b"abc", 2, 0x7F80)
    for width, mask in ((3, 0x7F), (8, 0x7F), (2, 0), (2, 0x10000)):
        with pytest.raises(ValueError, match="width 1, 2 or 4 bytes"):
            finite._finite.first_nonfinite(b"", width, mask)


# -- the codec -------------------------------------------------------------------------------

KEY = b"k" * 32
BIG = (256 << 10) // 2 * 3 + 7  # bfloat16 elements over three of the codec's scan blocks


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_finite_chunk_encodes_to_the_same_bytes_with_the_check(codec: str) -> None:
    x = tensor("bfloat16", BIG).view(torch.uint8).numpy()
    plain = encode_chunk(KEY, x, dtype="bfloat16", shape=(BIG,), codec=codec)
    checked = encode_chunk(KEY, x, dtype="bfloat16", shape=(BIG,), codec=codec, check_finite=True)
    assert [bytes(p) for p in checked] == [bytes(p) for p in plain]
    assert bytes(decode_chunk(KEY, b"".join(bytes(p) for p in checked)).payload) == x.tobytes()


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("place", [0, (256 << 10) // 2 - 1, (256 << 10) // 2, BIG - 1])
def test_a_chunk_holding_a_nan_is_refused_naming_the_element(codec: str, place: int) -> None:
    x = tensor("bfloat16", BIG)
    x[place] = float("nan")
    payload = x.view(torch.uint8).numpy()
    assert encode_chunk(KEY, payload, dtype="bfloat16", shape=(BIG,), codec=codec)  # unchecked: stored
    with pytest.raises(NonFiniteChunk, match=f"bfloat16 element {place}") as caught:
        encode_chunk(KEY, payload, dtype="bfloat16", shape=(BIG,), codec=codec, check_finite=True)
    assert caught.value.index == place


# -- the worker, on real KV tensors and a real tier --------------------------------------------

NUM_BLOCKS, SHAPE = 8, (1, 128, 8)
CONTENT = KVContent("cpu", heads=1, tokens=128, head_size=4, head_size_v=4, dtype="bfloat16")


@pytest.fixture(params=["raw", "zstd"])
def worker(tier: TierProcess, request: pytest.FixtureRequest) -> Iterator[KvtierWorker]:
    config = ConnectorConfig.from_extra_config(
        {"target": tier.target, "chunk_size": 256, "codec": request.param}
    )
    link = factory.connect(config, metrics.KV)
    worker = KvtierWorker(
        config, link.client, rank=0, num_blocks=NUM_BLOCKS, layer_order=("l0",),
        breaker=link.breaker, recorder=link.recorder,
    )  # fmt: skip
    worker.register_kv_caches(
        {"l0": torch.randn(NUM_BLOCKS, *SHAPE).to(torch.bfloat16)},
        order=KVOrder.named("LBHNC"), content=CONTENT,
    )  # fmt: skip
    yield worker
    worker.shutdown()


def test_chunks_whose_blocks_hold_a_nan_or_an_infinity_are_not_stored(
    worker: KvtierWorker, tier: TierProcess, caplog: pytest.LogCaptureFixture
) -> None:
    cache = worker.copies.copier(0)._views[0].layer
    cache[2, 0, 5, 1] = float("nan")
    cache[5, 0, 127, 7] = float("-inf")
    saves = [ChunkSave((f"c{i}".encode(),), (2 * i, 2 * i + 1)) for i in range(4)]
    plan = StepPlan(saves=saves)
    sender._nonfinite_logged.clear()  # no warning yet in this process

    with caplog.at_level(logging.WARNING, logger=sender.__name__):
        worker.start_load_kv(plan)
        worker.save_kv_layer("l0", plan)
        worker.wait_for_save(plan)
        assert worker.sender.flush(10.0)

    with TierClient(tier.target) as client:
        got = client.get([b"c0", b"c1", b"c2", b"c3"], stop_at_first_miss=False)
    assert [v is not None for v in got] == [True, False, False, True]  # blocks 2 and 5 are bad
    assert worker._recorder.total("saves_dropped", "nonfinite") == 2
    assert worker._recorder.total("saved_chunks") == 2
    warnings = [r for r in caplog.records if "NaN or an infinity" in r.getMessage()]
    assert len(warnings) == 1  # at most once a minute, however many chunks are refused
    assert "the first" in warnings[0].getMessage()
    assert sender._nonfinite_logged[metrics.KV.prefix][1] == 1  # the second, not logged


def test_a_stored_chunk_holding_a_nan_is_never_loaded(worker: KvtierWorker, tier: TierProcess) -> None:
    """A writer that does not check (an older connector, another client of the tenant)
    stored a NaN: the load fails verification (``nonfinite``), its blocks are recomputed,
    and the chunk is deleted. Loaded, it would poison this engine's KV cache."""
    shape = worker.copies.chunk_shape(0, 2)
    good = torch.randn(shape).to(torch.bfloat16)
    bad = good.clone()
    bad[0, 1, 0, 64, 3] = float("nan")
    with TierClient(tier.target) as client:
        for key, kv in ((b"good", good), (b"bad", bad)):
            payload = kv.view(torch.uint8).reshape(-1).numpy()
            assert client.put([(key, b"".join(encode_chunk(key, payload, dtype="bfloat16", shape=shape)))]) == 1
        loads = [
            RequestLoad(key.decode(), (ChunkLoad((key,), 0, (2 * i, 2 * i + 1)),))
            for i, key in enumerate((b"good", b"bad"))
        ]
        plan = StepPlan(loads=loads)
        worker.start_load_kv(plan)
        worker.wait_for_save(plan)
        assert worker.sender.flush(10.0)

        assert worker.failed_blocks() == {2, 3}
        assert worker._recorder.total("corrupt_chunks", "nonfinite") == 1
        cache = worker.copies.copier(0)._views[0].layer
        assert torch.isfinite(cache.float()).all()
        assert torch.equal(cache[0:2], good[0])  # the good chunk is loaded (layer 0)
        assert client.lookup([b"bad"]) == 0  # deleted


# -- fp8 KV caches: uint8 bytes, scanned as the fp8 type vLLM stores -----------------------------

FP8_CONTENT = KVContent("cpu", heads=1, tokens=128, head_size=4, head_size_v=4, dtype="uint8")


def fp8_worker(tier: TierProcess, values: list[str] | None) -> KvtierWorker:
    config = ConnectorConfig.from_extra_config({"target": tier.target, "chunk_size": 256})
    link = factory.connect(config, metrics.KV)
    worker = KvtierWorker(
        config, link.client, rank=0, num_blocks=NUM_BLOCKS, layer_order=("l0",),
        breaker=link.breaker, recorder=link.recorder,
    )  # fmt: skip
    cache = (torch.randn(NUM_BLOCKS, *SHAPE) * 8).to(torch.float8_e4m3fn).view(torch.uint8)
    worker.register_kv_caches({"l0": cache}, order=KVOrder.named("LBHNC"), content=FP8_CONTENT, values=values)
    return worker


@pytest.mark.parametrize(("values", "stored"), [(["float8_e4m3fn"], [True, False]), (None, [True, True])],
                         ids=["as-fp8", "as-uint8"])  # fmt: skip
def test_an_fp8_cache_is_scanned_as_its_fp8_type(
    tier: TierProcess, values: list[str] | None, stored: list[bool]
) -> None:
    """vLLM keeps an fp8 KV cache as uint8 bytes; scanned as float8_e4m3fn, the NaN byte
    0x7F is found (0x7E, 448, is not a NaN); scanned as uint8 (``values`` not given), nothing is."""
    worker = fp8_worker(tier, values)
    try:
        cache = worker.copies.copier(0)._views[0].layer
        cache[0, 0, 3, 2] = 0x7E  # 448: the largest finite e4m3fn
        cache[3, 0, 100, 0] = 0x7F  # NaN
        names = [f"fp8-{values is None}-{i}".encode() for i in range(2)]
        plan = StepPlan(saves=[ChunkSave((name,), (2 * i, 2 * i + 1)) for i, name in enumerate(names)])
        worker.start_load_kv(plan)
        worker.save_kv_layer("l0", plan)
        worker.wait_for_save(plan)
        assert worker.sender.flush(10.0)
        with TierClient(tier.target) as client:
            assert [v is not None for v in client.get(names, stop_at_first_miss=False)] == stored
        assert worker._recorder.total("saves_dropped", "nonfinite") == stored.count(False)
    finally:
        worker.shutdown()


def test_a_stored_fp8_chunk_holding_a_nan_is_never_loaded(tier: TierProcess) -> None:
    worker = fp8_worker(tier, ["float8_e4m3fn"])
    try:
        shape = worker.copies.chunk_shape(0, 2)
        payload = (torch.randn(shape) * 8).to(torch.float8_e4m3fn).view(torch.uint8)
        payload[0, 1, 0, 5, 3] = 0xFF  # -NaN
        with TierClient(tier.target) as client:
            blob = b"".join(encode_chunk(b"fp8-bad", payload.reshape(-1).numpy(), dtype="uint8", shape=shape))
            assert client.put([(b"fp8-bad", blob)]) == 1
            plan = StepPlan(loads=[RequestLoad("r", (ChunkLoad((b"fp8-bad",), 0, (4, 5)),))])
            worker.start_load_kv(plan)
            worker.wait_for_save(plan)
            assert worker.failed_blocks() == {4, 5}
            assert worker._recorder.total("corrupt_chunks", "nonfinite") == 1
    finally:
        worker.shutdown()


def test_finite_e4m3_bytes_pass_when_scanned_as_an_fp8_cache_is() -> None:
    """Every finite e4m3fn byte (what TRITON_ATTN writes for fp8_e5m2 too: 384 to 448 are
    0x7C to 0x7E, an e5m2 infinity or NaN) passes; 0x7F and 0xFF (NaN in e4m3fn and e5m2) do not."""
    values = torch.arange(256, dtype=torch.uint8)
    finite_bytes = values[torch.isfinite(values.view(torch.float8_e4m3fn).float())]
    assert len(finite_bytes) == 254
    assert finite.first_nonfinite(finite_bytes.numpy(), "float8_e4m3fn") == -1
    assert torch.tensor([384.0, 448.0, 1000.0]).to(torch.float8_e4m3fn).view(torch.uint8).tolist() == [0x7C, 0x7E, 0x7E]
    for nan in (0x7F, 0xFF):
        assert finite.first_nonfinite(bytes([0x10, nan]), "float8_e4m3fn") == 1
        assert not torch.isfinite(torch.tensor([nan], dtype=torch.uint8).view(torch.float8_e5m2).float())


def test_encode_chunk_scans_as_the_dtype_it_is_given() -> None:
    payload = bytes([0x10, 0x7E, 0x7F, 0x20])
    assert encode_chunk(KEY, payload, dtype="uint8", shape=(4,), check_finite=True)  # uint8: not scanned
    with pytest.raises(NonFiniteChunk, match=r"float8_e4m3fn element 2"):
        encode_chunk(KEY, payload, dtype="uint8", shape=(4,), check_finite="float8_e4m3fn")
    assert encode_chunk(KEY, payload, dtype="uint8", shape=(4,), check_finite="")  # "": not scanned


@pytest.mark.parametrize(
    ("cache_dtype", "stored", "scanned_as"),
    [
        ("auto", "bfloat16", "bfloat16"),
        ("fp8", "uint8", "float8_e4m3fn"),  # this platform's e4m3 (not ROCm's fnuz)
        ("fp8_e4m3", "uint8", "float8_e4m3fn"),
        ("fp8_e5m2", "uint8", "float8_e4m3fn"),  # 0x7F and 0xFF: NaN in e5m2 and e4m3 alike
        ("fp8_ds_mla", "uint8", ""),  # scales packed among the values: not scanned
        ("int8_per_token_head", "int8", "int8"),  # not floating point: first_nonfinite skips it
    ],
)
def test_each_cache_dtype_is_scanned_as_the_values_it_holds(cache_dtype: str, stored: str, scanned_as: str) -> None:
    """On this machine's platform (the CPU: e4m3 is e4m3fn, as on CUDA; not ROCm's fnuz)."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from kvtier.connector.kv import vllmspec

    assert current_platform.fp8_dtype() == torch.float8_e4m3fn

    content = KVContent("cpu", heads=1, tokens=128, head_size=4, head_size_v=4, dtype=stored)
    config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype))
    assert vllmspec.value_dtypes(config, [content, CONTENT]) == [scanned_as, "bfloat16"]
