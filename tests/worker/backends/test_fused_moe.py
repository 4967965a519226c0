"""The fused MoE layer's host side on the CPU: the sort-by-expert step the kernels read, and
the errors its inputs get (the kernels themselves: test_fused_moe_interpreted.py and
tests/gpu/test_fused_moe_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from worker.backends.fused_moe import _align, align_capacity, experts_from_float, experts_from_mxfp4, fused_moe


@pytest.mark.parametrize(
    ("t", "k", "e", "block"), [(1, 8, 128, 16), (37, 2, 8, 16), (300, 4, 32, 64), (64, 8, 128, 32)]
)
def test_align_puts_every_pair_once_in_its_experts_blocks(t: int, k: int, e: int, block: int) -> None:
    g = torch.Generator().manual_seed(t)
    # experts 0 .. e/2 only: the others get no pair
    ids = torch.stack([torch.randperm(e // 2, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    sorted_pairs, block_expert = _align(ids, e, block)
    assert sorted_pairs.numel() == align_capacity(t * k, e, block) == block_expert.numel() * block
    real = sorted_pairs[sorted_pairs < t * k]
    assert sorted(real.tolist()) == list(range(t * k)), "each (token, slot) pair exactly once"
    assert (sorted_pairs[sorted_pairs >= t * k] == t * k).all(), "padding holds the sentinel T * k"
    blocks = sorted_pairs.view(-1, block)
    flat = ids.reshape(-1).long()
    for b, expert in enumerate(block_expert.tolist()):
        pairs = blocks[b][blocks[b] < t * k].long()
        if expert < 0:
            assert pairs.numel() == 0, f"block {b} holds pairs but no expert"
        else:
            assert pairs.numel() > 0 and (flat[pairs] == expert).all(), f"block {b}: pairs of other experts"
    used = block_expert[block_expert >= 0]
    assert torch.equal(used, used.sort().values) and set(used.tolist()) == set(flat.tolist())


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"down \(2, 16, 8\) does not match gate_up"):
        experts_from_float(torch.zeros(2, 8, 16), torch.zeros(2, 16, 8))
    with pytest.raises(ValueError, match="gate_up_bias is"):
        experts_from_float(torch.zeros(2, 8, 16), torch.zeros(2, 16, 4), gate_up_bias=torch.zeros(2, 4))
    u8 = torch.uint8
    with pytest.raises(ValueError, match="MXFP4 down blocks"):
        experts_from_mxfp4(torch.zeros(2, 8, 1, 16, dtype=u8), torch.zeros(2, 8, 1, dtype=u8),
                           torch.zeros(2, 32, 1, 8, dtype=u8), torch.zeros(2, 32, 1, dtype=u8))  # fmt: skip
    experts = experts_from_float(torch.zeros(2, 8, 16), torch.zeros(2, 16, 4))
    ids, weights = torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    with pytest.raises(ValueError, match="x is"):
        fused_moe(torch.zeros(3, 8, dtype=torch.bfloat16), experts, ids, weights)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        fused_moe(torch.zeros(3, 16, dtype=torch.bfloat16), experts, ids, weights, "gelu")  # type: ignore[arg-type]
