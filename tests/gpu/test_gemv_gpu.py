"""The one-row GEMV (worker.backends.gemv) against float64 products, and its float32
logits against F.linear's. The batch-1 decode that runs on it is checked against
transformers by test_torch_backend_gpu and the other model tests here.

Tolerance: the kernel accumulates in float32 and rounds once to the output dtype, as
cuBLAS does; against the float64 product that is the output's rounding, 2^-8 relative
for bf16 per element; bound 1e-2 on the relative L2 (float32 out: 1e-5 before rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.backends import gemv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (577, 576), (3, 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_equals_the_product(n: int, k: int, dtype: torch.dtype, with_bias: bool) -> None:
    g = torch.Generator(device=CUDA).manual_seed(n + k)
    w = (torch.randn(n, k, device=CUDA, generator=g) * 0.05).to(dtype)
    x = torch.randn(1, k, device=CUDA, generator=g).to(dtype)
    bias = torch.randn(n, device=CUDA, generator=g).to(dtype) if with_bias else None
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    got = gemv.gemv(x, w, bias)
    assert got.shape == (1, n) and got.dtype == dtype
    assert rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_float32_logits_keep_the_inputs_precision() -> None:
    """The LM head's float32 out is rounded as F.linear's bf16 result then a cast."""
    g = torch.Generator(device=CUDA).manual_seed(0)
    w = (torch.randn(32000, 576, device=CUDA, generator=g) * 0.05).bfloat16()
    x = torch.randn(1, 576, device=CUDA, generator=g).bfloat16()
    got = gemv.gemv(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, got.bfloat16().float())  # every value is a bf16 value
    want = F.linear(x, w).float()
    # Summation order differs from cuBLAS: a value may land one bf16 step away.
    step = want.abs().clamp(min=1e-3) * 2**-7
    assert bool(((got - want).abs() <= step).all())


@pytest.mark.parametrize(("n", "k"), [(14336, 4096), (1536, 576), (5, 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_swiglu_equals_gemv_then_silu_mul(n: int, k: int, dtype: torch.dtype) -> None:
    """The gate_up projection with SwiGLU in its epilogue gives what the two launches it
    replaces give, bit for bit: each row is summed alike and rounded to the dtype before
    the activation, as the projection's output is."""
    from worker.backends import torch_ops

    g = torch.Generator(device=CUDA).manual_seed(n)
    w = (torch.randn(2 * n, k, device=CUDA, generator=g) * 0.05).to(dtype)
    x = torch.randn(1, k, device=CUDA, generator=g).to(dtype)
    got = gemv.gemv_swiglu(x, w)
    assert got.shape == (1, n) and got.dtype == dtype
    assert torch.equal(got, torch_ops.silu_mul_triton(gemv.gemv(x, w)))
