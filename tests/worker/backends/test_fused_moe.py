"""The fused MoE layer's host side on the CPU: the errors its inputs get (the kernels
themselves, the sort by expert included: test_fused_moe_interpreted.py and
tests/gpu/test_fused_moe_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from worker.backends.fused_moe import experts_from_float, experts_from_mxfp4, fused_moe


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
