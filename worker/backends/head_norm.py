"""The per-head RMSNorm of q and k (Qwen3, Gemma 3) over the fused qkv projection, in
one pass on CUDA.

The torch twin slices q and k out of qkv, normalizes each head and concatenates the
three parts again: three reads and writes of the q and k activations and a copy of v.
The Triton kernel normalizes each q and k head of qkv in place (one program per token and
head; v untouched), rounding as the twin does: the norm in float32, the normalized head
cast to the activation dtype, then scaled by the weight.
"""

from __future__ import annotations

import torch

from worker.backends import pdl, torch_ops

try:
    import triton  # type: ignore[import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # the CPU host
    triton = None


def head_norm_torch(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                    num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:  # fmt: skip
    t, d = qkv.shape[0], head_dim
    q_end, k_end = num_heads * d, (num_heads + num_kv_heads) * d
    q = torch_ops.rmsnorm_torch(qkv[:, :q_end].reshape(t, -1, d), q_weight, eps)
    k = torch_ops.rmsnorm_torch(qkv[:, q_end:k_end].reshape(t, -1, d), k_weight, eps)
    return torch.cat([q.reshape(t, -1), k.reshape(t, -1), qkv[:, k_end:]], dim=1)


if triton is not None:
    from worker.backends.pdl import wait as pdl_wait

    @triton.jit
    def _head_norm_kernel(  # type: ignore[no-untyped-def]
        qkv_ptr, qw_ptr, kw_ptr, stride_t, num_heads, head_dim, eps, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_wait(PDL)
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        ok = offs < head_dim
        # q heads, then k heads, lie one after the other from the row's start: head h at h * head_dim.
        ptrs = qkv_ptr + token * stride_t + head * head_dim + offs
        x = tl.load(ptrs, mask=ok, other=0.0)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, 0) / head_dim + eps)
        y = (xf * inv).to(x.dtype).to(tl.float32)
        if head < num_heads:
            w = tl.load(qw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        else:
            w = tl.load(kw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(ptrs, (y * w).to(x.dtype), mask=ok)


def head_norm_triton(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                     num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:  # fmt: skip
    """head_norm_torch's result, written into `qkv` (returned)."""
    n_rows = qkv.shape[0]
    if n_rows == 0:
        return qkv
    assert qkv.stride(1) == 1, "the kernel walks a head's elements contiguously"
    block = triton.next_power_of_2(head_dim)
    _head_norm_kernel[(n_rows, num_heads + num_kv_heads)](
        qkv, q_weight, k_weight, qkv.stride(0), num_heads, head_dim, eps, BLOCK=block,
        num_warps=max(1, min(4, block // 128)), **pdl.options(qkv.device, n_rows),
    )  # fmt: skip
    return qkv
