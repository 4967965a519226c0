"""The torch KV pool's host tier: blocks copied out and back arrive bit for bit, in
the pool's dtype (FP8 included), and a step queued after a copy sees its blocks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from worker.backends.torch_host_kv import TorchHostKv  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def pool(device: str, dtype: Any, layers: int = 3) -> tuple[list[Any], list[Any]]:
    """Random K and V caches of `layers` layers."""
    gen = torch.Generator().manual_seed(0)
    shape = (8, 4, 2, 16)  # [blocks, block_size, kv_heads, head_dim]
    k = [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(layers)]
    v = [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(layers)]
    return k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_blocks_offloaded_and_loaded_back_are_bit_identical(device: str, dtype: str) -> None:
    if dtype == "float8_e4m3fn" and device == "cpu" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8")
    k, v = pool(device, getattr(torch, dtype))
    before = [(a.clone(), b.clone()) for a, b in zip(k, v, strict=True)]
    host = TorchHostKv(k, v, num_blocks=4)
    host.offload(np.array([3, 1], dtype=np.int64), np.array([0, 2], dtype=np.int64))
    for a, b in zip(k, v, strict=True):  # the pool's blocks are reused (a step on the compute stream)
        a.view(torch.uint8).zero_()
        b.view(torch.uint8).zero_()
    host.load(np.array([2, 0], dtype=np.int64), np.array([5, 6], dtype=np.int64))
    got = [(a[[5, 6]].view(torch.uint8).cpu(), b[[5, 6]].view(torch.uint8).cpu()) for a, b in zip(k, v, strict=True)]
    if device == "cuda":
        torch.cuda.synchronize()
    for (want_k, want_v), (got_k, got_v) in zip(before, got, strict=True):
        assert torch.equal(got_k, want_k[[1, 3]].view(torch.uint8).cpu())
        assert torch.equal(got_v, want_v[[1, 3]].view(torch.uint8).cpu())
    assert host.slots.is_pinned() == (device == "cuda")
