"""The elementwise stages of a decoder layer, fused into single passes on CUDA.

Each op has a Triton kernel (CUDA) and a plain-torch twin (the CPU path, and the
reference the kernels are tested against); `use_triton` picks one. Fusing matters
for long prefill chunks, where each unfused stage is a full pass over [T, hidden]
activations; for generation steps the CUDA graph already hides the launches.

- add_rmsnorm: residual += x (in the activation dtype, as transformers does), then
  RMSNorm of the sum in float32.
- silu_mul: SwiGLU's silu(gate) * up over the fused gate_up projection.
- both, for a model with FP8 projections: the output's per-token e4m3 codes and scales
  too (`*_fp8_triton`), so the qkv, gate_up and down inputs need no pass of their own to
  be quantized (quant_linear.Fp8Linear takes them).
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
    from worker.backends.quant_linear import store_fp8_row

    @triton.jit
    def _add_rmsnorm_kernel(  # type: ignore[no-untyped-def]
        x_ptr, res_ptr, w_ptr, out_ptr, q_ptr, s_ptr, n_cols, eps, stride_x, stride_r, stride_o,
        HAS_RES: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
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
        out = (y * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + offs, out, mask=ok)
        if QUANT:
            store_fp8_row(out.to(tl.float32), q_ptr + row * n_cols + offs, s_ptr + row, ok)

    @triton.jit
    def _silu_mul_kernel(  # type: ignore[no-untyped-def]
        gu_ptr, out_ptr, q_ptr, s_ptr, n_cols, stride_gu, stride_o, QUANT: tl.constexpr, BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        # QUANT: a program takes a whole row (BLOCK >= n_cols), for its amax.
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n_cols
        g = tl.load(gu_ptr + row * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + n_cols + offs, mask=ok, other=0.0).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + offs, y, mask=ok)
        if QUANT:
            store_fp8_row(y.to(tl.float32), q_ptr + row * n_cols + offs, s_ptr + row, ok)

    @triton.jit
    def _rope_cache_kernel(  # type: ignore[no-untyped-def]
        qkv_ptr, pos_ptr, cs_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_qkv, stride_cs,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
        HALF_P2: tl.constexpr, HEAD_BLOCK: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # A program takes HEAD_BLOCK of a token's q | k | v heads, as [heads, half] tiles: q
        # rotated in place, k rotated into the cache, v copied there.
        pdl_wait(PDL)
        tok = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
        offs = tl.arange(0, HALF_P2)
        is_q = heads < NUM_HEADS
        is_v = heads >= NUM_HEADS + NUM_KV_HEADS
        ok = (heads < NUM_HEADS + 2 * NUM_KV_HEADS)[:, None] & (offs < HALF)[None, :]
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        cos = tl.load(cs_ptr + pos * stride_cs + offs, mask=offs < HALF, other=0.0)[None, :]
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs, mask=offs < HALF, other=0.0)[None, :]
        src = qkv_ptr + tok * stride_qkv + heads[:, None] * HEAD_DIM + offs[None, :]
        x1 = tl.load(src, mask=ok, other=0.0)
        x2 = tl.load(src + HALF, mask=ok, other=0.0)
        y1 = (x1.to(tl.float32) * cos - x2.to(tl.float32) * sin).to(x1.dtype)
        y2 = (x2.to(tl.float32) * cos + x1.to(tl.float32) * sin).to(x1.dtype)
        q_ok = ok & is_q[:, None]
        tl.store(src, y1, mask=q_ok)
        tl.store(src + HALF, y2, mask=q_ok)
        # K and V: float32 in both cases (y1 / y2 are already rounded to the activations'
        # dtype, so a bf16 cache stores the same values); v unrotated.
        c1 = tl.where(is_v[:, None], x1.to(tl.float32), y1.to(tl.float32))
        c2 = tl.where(is_v[:, None], x2.to(tl.float32), y2.to(tl.float32))
        if KV_FP8:  # an e4m3 cache (scale 1): saturate at +-448 rather than overflow to NaN
            c1 = tl.minimum(tl.maximum(c1, -448.0), 448.0)
            c2 = tl.minimum(tl.maximum(c2, -448.0), 448.0)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        kv_head = tl.where(is_v, heads - NUM_HEADS - NUM_KV_HEADS, heads - NUM_HEADS)
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head[:, None] * HEAD_DIM + offs[None, :]
        k_ok = ok & (~is_q & ~is_v)[:, None]
        v_ok = ok & is_v[:, None]
        tl.store(k_cache_ptr + dst, c1.to(k_cache_ptr.dtype.element_ty), mask=k_ok)
        tl.store(k_cache_ptr + dst + HALF, c2.to(k_cache_ptr.dtype.element_ty), mask=k_ok)
        tl.store(v_cache_ptr + dst, c1.to(v_cache_ptr.dtype.element_ty), mask=v_ok)
        tl.store(v_cache_ptr + dst + HALF, c2.to(v_cache_ptr.dtype.element_ty), mask=v_ok)


def add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return _add_rmsnorm(x, residual, weight, eps, quantize=False)[0]


def add_rmsnorm_fp8_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rmsnorm_triton, and its output's per-token FP8 codes [T, H] and float32
    scales [T, 1] from the same pass (the input an FP8 projection takes)."""
    out, q, scale = _add_rmsnorm(x, residual, weight, eps, quantize=True)
    assert q is not None and scale is not None
    return out, q, scale


def _add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 quantize: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    n_rows, n_cols = x.shape
    out = torch.empty_like(x)
    q, scale = _empty_fp8_rows(n_rows, n_cols, x.device) if quantize else (None, None)
    res = residual if residual is not None else x
    block = triton.next_power_of_2(n_cols)
    _add_rmsnorm_kernel[(n_rows,)](
        x, res, weight, out, out if q is None else q, out if scale is None else scale, n_cols, eps, x.stride(0),
        res.stride(0), out.stride(0), HAS_RES=residual is not None, QUANT=quantize, BLOCK=block,
        num_warps=min(16, max(1, block // 256)), **pdl.options(x.device, n_rows),
    )  # fmt: skip
    return out, q, scale


def _empty_fp8_rows(n_rows: int, n_cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((n_rows, n_cols), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((n_rows, 1), dtype=torch.float32, device=device))  # fmt: skip


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    return _silu_mul(gate_up, quantize=False)[0]


def silu_mul_fp8_triton(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """silu_mul_triton, and its output's per-token FP8 codes and scales (as add_rmsnorm_fp8_triton)."""
    out, q, scale = _silu_mul(gate_up, quantize=True)
    assert q is not None and scale is not None
    return out, q, scale


def _silu_mul(gate_up: torch.Tensor, quantize: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    n_rows, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n_rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    q, scale = _empty_fp8_rows(n_rows, n_cols, gate_up.device) if quantize else (None, None)
    block = triton.next_power_of_2(n_cols) if quantize else 1024
    _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
        gate_up, out, out if q is None else q, out if scale is None else scale, n_cols, gate_up.stride(0),
        out.stride(0), QUANT=quantize, BLOCK=block, num_warps=min(16, max(4, block // 1024)),
        **pdl.options(out.device, n_rows),
    )  # fmt: skip
    return out, q, scale


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
    # Many tokens: 16 heads a program (a head a program left prefill at a third of the
    # bandwidth, 200 us a layer for 8192 tokens on an H100); few: 2, so a decode step of a
    # few rows still spreads over the SMs.
    head_block = 16 if t >= 64 else 2
    heads = num_heads + 2 * num_kv_heads
    _rope_cache_kernel[(t, triton.cdiv(heads, head_block))](
        qkv, positions, cos_sin, k_cache, v_cache, slots, qkv.stride(0), cos_sin.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        HALF_P2=triton.next_power_of_2(head_dim // 2), HEAD_BLOCK=head_block,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=4 if head_block > 2 else 1,
        **pdl.options(qkv.device, t),
    )  # fmt: skip
    return qkv[:, : num_heads * head_dim].view(t, num_heads, head_dim)
