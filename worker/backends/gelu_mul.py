"""Gemma's GeGLU, gelu_tanh(gate) * up over the fused gate_up projection, in one pass on
CUDA (the torch twin makes the gate and up views, the GELU's output, then the product).
The kernel rounds as the twin does: the GELU in float32 rounded to the activation dtype,
then the product rounded again."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.backends import pdl

try:
    import triton  # type: ignore[import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # the CPU host
    triton = None

BLOCK = 1024


def gelu_tanh_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


if triton is not None:
    from worker.backends.pdl import wait as pdl_wait

    @triton.jit
    def _gelu_tanh_mul_kernel(  # type: ignore[no-untyped-def]
        gu_ptr, out_ptr, n_cols, stride_gu, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n_cols
        g_in = tl.load(gu_ptr + row * stride_gu + offs, mask=ok, other=0.0)
        g = g_in.to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + n_cols + offs, mask=ok, other=0.0).to(tl.float32)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi)
        tanh = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * inner))  # saturates to +-1 where exp over- or underflows
        act = (0.5 * g * (1.0 + tanh)).to(g_in.dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (act * u).to(out_ptr.dtype.element_ty), mask=ok)


def gelu_tanh_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    n_rows, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n_rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if n_rows == 0:
        return out
    _gelu_tanh_mul_kernel[(n_rows, triton.cdiv(n_cols, BLOCK))](
        gate_up, out, n_cols, gate_up.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4,
        **pdl.options(out.device, n_rows),
    )  # fmt: skip
    return out
