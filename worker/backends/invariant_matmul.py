"""Matrix products whose every row comes out bit for bit the same whatever the batch.

A BLAS library and cuBLAS pick their kernel, blocking, split-K and thread split from the
shape, so one row of `x @ W` can differ in its low bits between a batch of 1 and a batch
of 32: the same request would see slightly different logits, and a seeded sample could
change, depending on its batch-mates.

On the CPU the rows go through the library in calls of a fixed row count (row_tiles.py).
On CUDA one Triton GEMM with a single tile configuration and no split-K: each output is
reduced over K in BLOCK_K steps in the same order whatever M is, in one launch (cuBLAS
in fixed row tiles would be as invariant, but a long prompt would take hundreds of
launches per projection).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.backends.row_tiles import linear_rows_torch

if TYPE_CHECKING:
    import torch

try:
    import triton  # type: ignore[import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # a host without Triton: the CPU paths only
    triton = None

# The one Triton tile: 64 rows (a wgmma's M) by 128 outputs, K in steps of 64.
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 128, 64, 4, 3


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """F.linear (x [M, K], weight [N, K]) → [M, N] in `out_dtype` (default x's): the Triton
    GEMM on CUDA, cuBLAS-free; on the CPU the library in fixed row tiles (row_tiles.py)."""
    if x.is_cuda and triton is not None:
        return matmul_triton(x, weight, bias, out_dtype)
    return linear_rows_torch(x, weight, bias, out_dtype)


if triton is not None:

    @triton.jit
    def _matmul_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
        HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok, n_ok = offs_m < M, offs_n < N
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # The whole K in one program, in BLOCK_K steps from 0: the order of every output's sum
        # is fixed by K alone. Rows past M load as zeros and are never stored.
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def matmul_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ weight [N, K]^T (+ bias [N]) → [M, N] in `out_dtype` (default x's), the sums
    in float32 (float32 inputs as IEEE float32, not TF32: TF32 would round them first)."""
    import torch

    if triton is None:
        raise RuntimeError("matmul_triton needs Triton")
    m, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else out, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out
