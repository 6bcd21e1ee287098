"""``KVTIER_POISON_RECYCLED``: buffers given back are poisoned before they are kept, so
a read of one after it was given back (the race issue 21's defect 1 suspects) sees 0xFF
bytes, a NaN in the KV cache's dtypes, at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.proto.buffers import MIN_BYTES, POISON_ENV, ReceiveBuffers


def given_back_then_taken(buffers: ReceiveBuffers, size: int) -> bytearray:
    buf = buffers.take(size)
    memoryview(buf)[:] = b"\x01" * size  # a value's bytes
    values: list[object] = [memoryview(buf)]
    identity = id(buf)
    del buf
    assert buffers.give_back(values) == 1
    again = buffers.take(size)
    assert id(again) == identity  # the same buffer, recycled
    return again


def test_buffers_given_back_are_poisoned_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POISON_ENV, "1")
    again = given_back_then_taken(ReceiveBuffers(8 * MIN_BYTES), 2 * MIN_BYTES)
    assert again == b"\xff" * (2 * MIN_BYTES)
    as_bf16 = torch.frombuffer(again, dtype=torch.bfloat16)
    assert torch.isnan(as_bf16).all()


def test_pinned_style_buffers_are_poisoned_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POISON_ENV, "1")
    buffers = ReceiveBuffers(8 * MIN_BYTES)
    buffers.allocate = lambda n: np.zeros(n, dtype=np.uint8)  # the worker's kind on a GPU
    again = given_back_then_taken(buffers, MIN_BYTES)
    assert bytes(again) == b"\xff" * MIN_BYTES


def test_without_the_switch_a_recycled_buffer_keeps_its_old_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(POISON_ENV, raising=False)
    again = given_back_then_taken(ReceiveBuffers(8 * MIN_BYTES), MIN_BYTES)
    assert again == b"\x01" * MIN_BYTES  # nothing written: the default costs nothing
