"""The fused Triton elementwise kernels against their plain-torch twins, in bf16.
They round at the same points, so the tolerance is a few bf16 ulps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worker.backends import torch_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BF16: dict[str, Any] = {"dtype": torch.bfloat16, "device": "cuda"}


def check_close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm(with_residual: bool) -> None:
    x, w = torch.randn(77, 4096, **BF16), torch.randn(4096, **BF16)
    r1 = torch.randn(77, 4096, **BF16) if with_residual else None
    r2 = r1.clone() if r1 is not None else None
    check_close(torch_ops.add_rmsnorm_triton(x, r1, w, 1e-5), torch_ops.add_rmsnorm_torch(x, r2, w, 1e-5))
    if r1 is not None and r2 is not None:
        check_close(r1, r2)


@pytest.mark.parametrize("rows", [1, 77, 300])
def test_fp8_outputs_equal_the_row_quantization(rows: int) -> None:
    """The norm's and SwiGLU's e4m3 codes and scales, made in their own pass, are those
    quant_linear.quantize_rows_fp8 makes of their output."""
    from worker.backends import quant_linear

    x, w, res = torch.randn(rows, 4096, **BF16), torch.randn(4096, **BF16), torch.randn(rows, 4096, **BF16)
    res2 = res.clone()
    gate_up = torch.randn(rows, 2 * 14336, **BF16) * 3
    normed = torch_ops.add_rmsnorm_fp8_triton(x, res, w, 1e-5)
    assert torch.equal(normed[0], torch_ops.add_rmsnorm_triton(x, res2, w, 1e-5))
    assert torch.equal(res, res2)
    silu = torch_ops.silu_mul_fp8_triton(gate_up)
    assert torch.equal(silu[0], torch_ops.silu_mul_triton(gate_up))
    for out, codes, scales in (normed, silu):
        want_codes, want_scales = quant_linear.quantize_rows_fp8(out)
        assert torch.equal(scales, want_scales)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


def test_silu_mul() -> None:
    gu = torch.randn(33, 2 * 14336, **BF16)
    check_close(torch_ops.silu_mul_triton(gu), torch_ops.silu_mul_torch(gu))


@pytest.mark.parametrize("t", [1, 45, 300])  # 2 heads a program below 64 tokens, 16 from there
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rope_and_cache(t: int, cache_dtype: torch.dtype) -> None:
    heads, kv_heads, dim = 32, 8, 128
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, **BF16)
    pos = torch.randint(0, 4000, (t,), device="cuda", dtype=torch.int32)
    cos_sin = torch.randn(4096, dim, device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:t].to(torch.int32)
    caches = [torch.zeros(64, 16, kv_heads, dim, dtype=cache_dtype, device="cuda") for _ in range(4)]
    q1 = torch_ops.rope_and_cache_triton(qkv.clone(), pos, cos_sin, caches[0], caches[1], slots, heads, kv_heads, dim)
    q2 = torch_ops.rope_and_cache_torch(qkv.clone(), pos, cos_sin, caches[2], caches[3], slots, heads, kv_heads, dim)
    check_close(q1, q2)
    check_close(caches[0], caches[2])
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))  # V is copied, not computed


@pytest.mark.parametrize(("rows", "vocab"), [(1, 128256), (4, 49152), (300, 32000)])
def test_argmax_logsumexp_equals_torch(rows: int, vocab: int) -> None:
    """The sampler's one-pass argmax and log-sum-exp (worker.backends.logits_argmax) against
    torch.argmax and torch.logsumexp, ties across chunks and a row of -inf included, and
    the same answer on a second call (the counts are left at zero)."""
    from worker.backends import logits_argmax

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, vocab, device="cuda", generator=g) * 3
    x[0, vocab - 5] = x[0, 7] = 50.0
    x[-1] = float("-inf")
    ids, lse = logits_argmax.argmax_logsumexp(x)
    assert torch.equal(ids, x.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(x, dim=-1), rtol=1e-5, atol=1e-5)
    again = logits_argmax.argmax_logsumexp(x)
    assert torch.equal(again[0], ids) and torch.equal(again[1], lse)
