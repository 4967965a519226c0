"""The families' kernels on CUDA, the per-head q/k RMSNorm and GeGLU, against their torch
twins (the families' greedy tokens on CUDA, which run them, are in test_families_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from worker.backends.gelu_mul import gelu_tanh_mul_torch, gelu_tanh_mul_triton
from worker.backends.head_norm import head_norm_torch, head_norm_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 8, 128), (16, 8, 256), (4, 2, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 300])
def test_head_norm_matches_torch_on_cuda(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, tokens: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda", generator=gen).to(dtype)
    q_w = torch.randn(dim, device="cuda", generator=gen).to(dtype)
    k_w = torch.randn(dim, device="cuda", generator=gen).to(dtype)
    want = head_norm_torch(qkv, q_w, k_w, 1e-6, heads, kv_heads, dim)
    got = head_norm_triton(qkv.clone(), q_w, k_w, 1e-6, heads, kv_heads, dim)
    # float32: the norm's sums of `dim` squares in another order; bf16: neighbouring roundings of
    # the normalized head (one ulp) and of its product with the weight
    rtol = 2**-6 if dtype == torch.bfloat16 else dim * torch.finfo(torch.float32).eps
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=rtol)
    v = slice((heads + kv_heads) * dim, None)
    assert torch.equal(got[:, v], qkv[:, v])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 300])
def test_gelu_tanh_mul_matches_torch_on_cuda(dtype: torch.dtype, tokens: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(tokens, 2 * 15360, device="cuda", generator=gen) * 3).to(dtype)  # Gemma-3-12B's width
    got, want = gelu_tanh_mul_triton(gate_up).float(), gelu_tanh_mul_torch(gate_up).float()
    # float32: tanh from exp against torch's tanh, a few roundings apart; bf16: neighbouring
    # roundings of the GELU (one ulp) and of the product
    rtol = 2**-6 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, atol=1e-5, rtol=rtol)
