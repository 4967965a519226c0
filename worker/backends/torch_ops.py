"""The elementwise stages of a decoder layer, fused into single passes on CUDA.

Each op has a Triton kernel (CUDA) and a plain-torch twin (the CPU path, and the
reference the kernels are tested against); `use_triton` picks one. Fusing matters
for long prefill chunks, where each unfused stage is a full pass over [T, hidden]
activations; for generation steps the CUDA graph already hides the launches.

- add_rmsnorm: residual += x (in the activation dtype, as transformers does), then
  RMSNorm of the sum in float32.
- silu_mul: SwiGLU's silu(gate) * up over the fused gate_up projection.
- rope_and_cache: rotary embedding (rotate-half layout) applied in place to the
  q and k heads of the fused qkv projection, and the new K and V written to their
  paged cache slots, in one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.backends import pdl

try:
    import triton  # type: ignore[import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # the CPU host
    triton = None


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rmsnorm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise x (+ residual, which is updated in place to the sum)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    return rmsnorm_torch(x, weight, eps)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_and_cache_torch(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Returns q [T, H, D] rotated; writes rotated k and v into the caches at slots."""
    t = qkv.shape[0]
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].view(t, num_heads, head_dim)
    k = qkv[:, q_end:k_end].view(t, num_kv_heads, head_dim)
    v = qkv[:, k_end:].view(t, num_kv_heads, head_dim)
    half = head_dim // 2
    cs = cos_sin[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    q = _rotate(q, cos, sin)
    k = _rotate(k, cos, sin)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    if k_cache.dtype == torch.float8_e4m3fn:  # an e4m3 cache (scale 1): saturate, as the kernel does;
        # written as bytes (index_copy_ takes no float8 on the CPU)
        k = k.float().clamp(-448.0, 448.0).to(k_cache.dtype).view(torch.uint8)
        v = v.float().clamp(-448.0, 448.0).to(v_cache.dtype).view(torch.uint8)
        flat_k, flat_v = flat_k.view(torch.uint8), flat_v.view(torch.uint8)
    flat_k.index_copy_(0, slots.long(), k)
    flat_v.index_copy_(0, slots.long(), v)
    return q


if triton is not None:
    from worker.backends.pdl import wait as pdl_wait

    @triton.jit
    def _add_rmsnorm_kernel(  # type: ignore[no-untyped-def]
        x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, stride_x, stride_r, stride_o,
        HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < n_cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_r + offs, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
            tl.store(res_ptr + row * stride_r + offs, x, mask=ok)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
        y = (xf * inv).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(  # type: ignore[no-untyped-def]
        gu_ptr, out_ptr, n_cols, stride_gu, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr
    ):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n_cols
        g = tl.load(gu_ptr + row * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + n_cols + offs, mask=ok, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_cache_kernel(  # type: ignore[no-untyped-def]
        qkv_ptr, pos_ptr, cs_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_qkv, stride_cs,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
        HALF_P2: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_wait(PDL)
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half = HALF
        offs = tl.arange(0, HALF_P2)
        ok = offs < half
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        cos = tl.load(cs_ptr + pos * stride_cs + offs, mask=ok, other=0.0)
        sin = tl.load(cs_ptr + pos * stride_cs + half + offs, mask=ok, other=0.0)
        base = qkv_ptr + tok * stride_qkv + head * HEAD_DIM
        x1 = tl.load(base + offs, mask=ok, other=0.0)
        x2 = tl.load(base + half + offs, mask=ok, other=0.0)
        y1 = (x1.to(tl.float32) * cos - x2.to(tl.float32) * sin).to(x1.dtype)
        y2 = (x2.to(tl.float32) * cos + x1.to(tl.float32) * sin).to(x1.dtype)
        if head < NUM_HEADS:
            tl.store(base + offs, y1, mask=ok)
            tl.store(base + half + offs, y2, mask=ok)
        else:
            kv_head = head - NUM_HEADS
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            dst = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
            vsrc = qkv_ptr + tok * stride_qkv + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
            # float32 in both branches (Triton wants one type per name); y1 / y2 are already
            # rounded to the activations' dtype, so a bf16 cache stores the same values.
            k1 = y1.to(tl.float32)
            k2 = y2.to(tl.float32)
            v1 = tl.load(vsrc + offs, mask=ok, other=0.0).to(tl.float32)
            v2 = tl.load(vsrc + half + offs, mask=ok, other=0.0).to(tl.float32)
            if KV_FP8:  # an e4m3 cache (scale 1): saturate at +-448 rather than overflow to NaN
                k1 = tl.minimum(tl.maximum(k1, -448.0), 448.0)
                k2 = tl.minimum(tl.maximum(k2, -448.0), 448.0)
                v1 = tl.minimum(tl.maximum(v1, -448.0), 448.0)
                v2 = tl.minimum(tl.maximum(v2, -448.0), 448.0)
            tl.store(k_cache_ptr + dst + offs, k1.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(k_cache_ptr + dst + half + offs, k2.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(v_cache_ptr + dst + offs, v1.to(v_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(v_cache_ptr + dst + half + offs, v2.to(v_cache_ptr.dtype.element_ty), mask=ok)


def add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    n_rows, n_cols = x.shape
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    block = triton.next_power_of_2(n_cols)
    _add_rmsnorm_kernel[(n_rows,)](
        x, res, weight, out, n_cols, eps, x.stride(0), res.stride(0), out.stride(0),
        HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        **pdl.options(x.device, n_rows),
    )  # fmt: skip
    return out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    n_rows, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n_rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
        gate_up, out, n_cols, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4,
        **pdl.options(out.device, n_rows),
    )  # fmt: skip
    return out


def rope_and_cache_triton(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    t = qkv.shape[0]
    _rope_cache_kernel[(t, num_heads + num_kv_heads)](
        qkv, positions, cos_sin, k_cache, v_cache, slots, qkv.stride(0), cos_sin.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        HALF_P2=triton.next_power_of_2(head_dim // 2), KV_FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=1,
        **pdl.options(qkv.device, t),
    )  # fmt: skip
    return qkv[:, : num_heads * head_dim].view(t, num_heads, head_dim)
