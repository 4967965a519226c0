"""One-row products on CUDA: `x [1, K] @ W[N, K]^T (+ bias)` as a Triton GEMV.

A decode step at batch 1 is bound by reading the weights once. cuBLAS serves a 1-row
F.linear with GEMM kernels that leave bandwidth unused on some shapes: on the H100, with
each layer's weights cold in L2 as in a real step, the 8B's o_proj (4096 x 4096) took
16.6 us against 13.4 for this kernel, and one layer's four projections 164.6 us against
151.6 (bench/results/gemv_sweep_h100_2026-11-23.txt). Each program owns BLOCK_N output
rows and walks K in BLOCK_K-wide tiles: every weight is loaded once, in long coalesced
rows, and the row sums are reduced in registers, so a call is one launch with no split-K
combine. The output may be float32 (the LM head's logits) without a cast launch; its
values are rounded to x's precision, as cuBLAS's then a cast would give them, so greedy
choices between near-tied logits do not move. FP8 projections (W8A8, per-token input and
per-channel weight scales) take it too, on their e4m3 codes: at one row torch._scaled_mm
reads the weights at a third of the bandwidth (33 us for the 8B's qkv on the H100, where
the bf16 GEMV takes 25 us for twice the bytes).

Why hand-written: neither cuBLAS nor torch has a GEMV entry point that picks this shape
for bf16, and no maintained library ships one that installs from the registry onto the
GPU host (torch and Triton, no compiler toolchain).
"""

from __future__ import annotations

import torch

from worker.backends import pdl

try:
    import triton  # type: ignore[import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # the CPU host
    triton = None


if triton is not None:
    from worker.backends.pdl import wait as pdl_wait

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _gemv_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, b_ptr, xs_ptr, ws_ptr, out_ptr, N, K, stride_w,
        HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, EVEN_K: tl.constexpr, ROUND: tl.constexpr,
        SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if SWIGLU:  # the tile's rows: gate row n, up row n (N further down), for BLOCK_N / 2 n
            offs_n = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
            weight_rows = offs_n + (tl.arange(0, BLOCK_N) % 2) * N
        else:
            offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            weight_rows = offs_n
        n_ok = offs_n < N
        cols = tl.arange(0, BLOCK_K)
        rows = w_ptr + weight_rows[:, None].to(tl.int64) * stride_w
        # The weights are no kernel's output: the first tile is read before the wait for the
        # kernel before (PDL), so its latency overlaps that kernel's end.
        w = tl.load(rows + cols[None, :], mask=n_ok[:, None] & (cols < K)[None, :], other=0.0)
        pdl_wait(PDL)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + cols
            if EVEN_K:
                w = tl.load(rows + k[None, :], mask=n_ok[:, None], other=0.0)
                x = tl.load(x_ptr + k)
            else:
                w = tl.load(rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
                x = tl.load(x_ptr + k, mask=k < K, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        total = tl.sum(acc, axis=1)
        if SCALED:  # e4m3 codes: the input's scale and each weight row's
            total *= tl.load(xs_ptr) * tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
        if SWIGLU:  # rounded to the output's dtype (x's) first, as the projection's output is before silu_mul
            gate, up = tl.split(tl.reshape(total.to(out_ptr.dtype.element_ty).to(tl.float32), (BLOCK_N // 2, 2)))
            offs_out = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            y = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(out_ptr + offs_out, y.to(out_ptr.dtype.element_ty), mask=offs_out < N)
            return
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if ROUND:  # float32 out with x's precision, as F.linear(...).float() gives it
            total = total.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def _plan(n: int, k: int, weight_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps). bf16, from the H100 sweep over the 8B's projections:
    the wide and the deep layers like 1024-input tiles and 8 warps, the 4096-square o_proj
    512 and 4 (more programs per SM hide its shorter rows). e4m3, from the H200 sweep
    (`python3 -m bench.gemv_bench`, bench/results/gemv_bench_fp8_tiles_h200_2026-11-29.txt): the
    wide layers (gate_up, an LM head) 8 rows of 512 inputs and 4 warps (gate_up 32.6 us
    against 37.9 with the bf16 tiles widened to the same bytes, floor 28.1), the rest 4 rows
    of 1024 and 4 warps."""
    if weight_bytes == 1:
        return (8, 512, 4) if n >= 8192 else (4, 1024, 4)
    if n >= 8192 or k >= 8192:
        return 4, 1024, 8
    return 4, 512, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None,
         scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
    """x [1, K] @ weight [N, K]^T (+ bias [N]) -> [1, N] in `out_dtype` (default x's).
    `scales` (x's [1, 1], the weight's [1, N]): x and weight are e4m3 codes (W8A8), their
    product scaled back before the bias; `out_dtype` is then required."""
    n, k = weight.shape
    block_n, block_k, warps = _plan(n, k, weight.element_size())
    out = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    x_scale, w_scale = scales if scales is not None else (weight, weight)  # (unused then)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x.contiguous(), weight, weight if bias is None else bias, x_scale, w_scale, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, SCALED=scales is not None, EVEN_K=k % block_k == 0,
        ROUND=scales is None and out.dtype != x.dtype, SWIGLU=False, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=3, **pdl.options(x.device, 1),
    )  # fmt: skip
    return out


def gemv_swiglu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """x [1, K] and the fused gate | up weight [2 N, K] -> silu(x @ gate^T) * (x @ up^T)
    [1, N] in x's dtype: the projection and SwiGLU in one launch, the same values as
    gemv then silu_mul. A program's rows are gate and up rows in pairs, summed as gemv sums
    a row, and rounded to x's dtype before the activation."""
    two_n, k = gate_up.shape
    block_n, block_k, warps = _plan(two_n, k, gate_up.element_size())
    out = torch.empty((1, two_n // 2), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(two_n, block_n),)](
        x.contiguous(), gate_up, gate_up, gate_up, gate_up, out, two_n // 2, k, gate_up.stride(0), HAS_BIAS=False,
        SCALED=False, EVEN_K=k % block_k == 0, ROUND=False, SWIGLU=True, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=3, **pdl.options(x.device, 1),
    )  # fmt: skip
    return out
