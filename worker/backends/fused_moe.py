"""The fused mixture-of-experts layer on CUDA: every token through its k routed experts in
two grouped-GEMM launches, with the expert weights in bf16, FP8 or MXFP4.

out [T, H] = sum_j topk_weights[t, j] * down_e(act(gate_up_e(x[t]))), e = topk_ids[t, j].

The steps, none of which reads a device value on the host (a step of fixed-size buffers, so
it can be captured in a CUDA graph at each batch size):
1. Align (torch ops): the T * k (token, slot) pairs sorted by expert, each expert's run
   padded to whole BLOCK_M row blocks; `sorted_pairs` holds pair indices (T * k where a
   block is padding) and `block_expert` each block's expert (-1 past the last used block).
   Both are sized for the worst case, T * k + min(E, T * k) * (BLOCK_M - 1) rows.
2. gate_up: one launch over (row block, column tile of I); each program gathers its tokens'
   rows of x, multiplies by its expert's gate and up tiles into two float32 accumulators,
   and applies the bias and the activation in the epilogue: [T * k, I] bf16, row = pair.
3. down: one launch the same way over [T * k, I] -> [T * k, H], each row scaled by its
   routing weight (after the bias, as the models apply them) and written in float32.
4. The k rows of each token summed (torch): atomic-free, so the sum's order is fixed and a
   token's output does not depend on which programs ran first; a float32 atomic add into
   [T, H] would save this pass but round differently from run to run. The pass reads
   T * k * H floats, small beside the expert weights a step streams.

Weights stay in their format in HBM and are dequantized to bf16 in registers tile by tile
(W8A16, W4A16): the MoE layers of a decode step are bound by the bytes of the routed
experts, which FP8 and MXFP4 halve and quarter, while the tensor cores idle; bf16
activations need no quantizing pass and add no rounding of their own. E4M3 and E2M1 values
(times a power-of-two scale) are exact in bf16, so the only roundings are the bf16
activations. Prefill at thousands of tokens would run FP8 faster as W8A8; not done here.

Formats (`ExpertWeights.format`):
- "bf16": gate_up [E, 2I, H], down [E, H, I] bf16.
- "fp8": e4m3, the same shapes, float32 scales per output channel [E, 2I] and [E, H],
  applied in the epilogue.
- "fp8_block": e4m3 with float32 scales per 128x128 block, [E, ceil(out/128), ceil(in/128)],
  applied to each K step's product (BLOCK_K divides 128).
- "mxfp4": worker/models/mxfp4.py's format, packed uint8 [E, out, in / 2] (two E2M1 codes
  a byte, the even element in the low nibble) with E8M0 scales uint8 [E, out, in / 32].

Tiles are chosen by T from `TILES` (the first whose bound T does not exceed).

Expert parallelism (worker/parallel/expert_parallel.py): a rank stacks only its own contiguous
run of experts, from global id `expert_start`. Step 1 maps the global ids to local ones and
files the pairs routed to other ranks' experts under one extra expert whose blocks are
marked -1, so neither launch computes them; their rows of step 3's output are zeros, so
they add nothing to step 4's sum.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

try:
    import triton  # type: ignore[import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # the CPU host
    triton = None

Format = Literal["bf16", "fp8", "fp8_block", "mxfp4"]
Activation = Literal["silu", "swiglu_clamped"]
FORMATS: tuple[Format, ...] = ("bf16", "fp8", "fp8_block", "mxfp4")
ACTIVATIONS: tuple[Activation, ...] = ("silu", "swiglu_clamped")
# gpt-oss's clamped SwiGLU: gate = min(gate, LIMIT), up = clamp(up, -LIMIT, LIMIT),
# out = (up + 1) * gate * sigmoid(ALPHA * gate).
CLAMPED_SWIGLU_ALPHA = 1.702
CLAMPED_SWIGLU_LIMIT = 7.0
FP8_MAX = 448.0  # the largest e4m3 value
FP8_BLOCK = 128  # the block of one scale in "fp8_block"
MXFP4_BLOCK = 32  # values per E8M0 scale


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """One MoE layer's experts, all in one format (see the module docstring)."""

    format: Format
    gate_up: torch.Tensor  # [E, 2I, H]: the I gate rows, then the I up rows; mxfp4: uint8 [E, 2I, H / 2]
    down: torch.Tensor  # [E, H, I]; mxfp4: uint8 [E, H, I / 2]
    # bf16: None; fp8: float32 [E, 2I] / [E, H]; fp8_block: float32 [E, ceil(out / 128),
    # ceil(in / 128)]; mxfp4: uint8 E8M0 [E, 2I, H / 32] / [E, H, I / 32]
    gate_up_scale: torch.Tensor | None
    down_scale: torch.Tensor | None
    gate_up_bias: torch.Tensor | None  # [E, 2I], float32 or bf16
    down_bias: torch.Tensor | None  # [E, H], float32 or bf16

    @property
    def num_experts(self) -> int:
        return int(self.gate_up.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.down.shape[1])

    @property
    def intermediate(self) -> int:
        return int(self.gate_up.shape[1]) // 2

    def nbytes_per_expert(self) -> int:
        """HBM bytes of one expert's weights, scales and biases (what routing a token to it reads)."""
        parts = (self.gate_up, self.down, self.gate_up_scale, self.down_scale, self.gate_up_bias, self.down_bias)
        return sum(p.numel() * p.element_size() for p in parts if p is not None) // self.num_experts


def experts_from_float(gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                       down_bias: torch.Tensor | None = None, format: Format = "bf16") -> ExpertWeights:  # fmt: skip
    """A layer's experts from float weights, gate_up [E, 2I, H] (gate rows first) and down
    [E, H, I], in bf16 or quantized to e4m3 on the tensors' device ("fp8": amax / 448 per
    output channel; "fp8_block": per 128x128 block)."""
    _check_shapes(gate_up.shape, down.shape, gate_up_bias, down_bias)
    if format == "bf16":
        return ExpertWeights("bf16", gate_up.to(torch.bfloat16).contiguous(), down.to(torch.bfloat16).contiguous(),
                             None, None, gate_up_bias, down_bias)  # fmt: skip
    if format == "fp8":
        (gu, gu_s), (d, d_s) = _fp8_per_channel(gate_up), _fp8_per_channel(down)
    elif format == "fp8_block":
        (gu, gu_s), (d, d_s) = _fp8_per_block(gate_up), _fp8_per_block(down)
    else:
        raise ValueError(f"experts_from_float quantizes to bf16, fp8 or fp8_block, not {format!r}")
    return ExpertWeights(format, gu, d, gu_s, d_s, gate_up_bias, down_bias)


def experts_from_mxfp4(gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, down_blocks: torch.Tensor,
                       down_scales: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                       down_bias: torch.Tensor | None = None,
                       gate_up_interleaved: bool = False) -> ExpertWeights:  # fmt: skip
    """A layer's experts from MXFP4 tensors as checkpoints ship them: blocks uint8 [E, out,
    in / 32, 16], scales uint8 [E, out, in / 32], for gate_up (out 2I) and down (out H).
    gpt-oss interleaves gate_up's rows (gate, up, gate, up, ...) and its bias likewise:
    `gate_up_interleaved` reorders both to the gate rows first (bytes moved, no rounding)."""
    for name, blocks, scales in (("gate_up", gate_up_blocks, gate_up_scales), ("down", down_blocks, down_scales)):
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError(f"MXFP4 {name} blocks and scales are uint8 (got {blocks.dtype} and {scales.dtype})")
        if blocks.dim() != 4 or blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
            raise ValueError(f"MXFP4 {name} blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}: "
                             f"blocks are [E, out, G, {MXFP4_BLOCK // 2}] for scales [E, out, G]")  # fmt: skip
    e, two_i, g_h = gate_up_scales.shape
    gate_up = gate_up_blocks.reshape(e, two_i, g_h * MXFP4_BLOCK // 2)
    down = down_blocks.reshape(e, down_blocks.shape[1], down_blocks.shape[2] * MXFP4_BLOCK // 2)
    _check_shapes((e, two_i, g_h * MXFP4_BLOCK), (e, down.shape[1], down.shape[2] * 2), gate_up_bias, down_bias)
    if gate_up_interleaved:
        order = torch.cat([torch.arange(0, two_i, 2), torch.arange(1, two_i, 2)]).to(gate_up.device)
        gate_up, gate_up_scales = gate_up[:, order], gate_up_scales[:, order]
        gate_up_bias = None if gate_up_bias is None else gate_up_bias[:, order.to(gate_up_bias.device)]
    return ExpertWeights("mxfp4", gate_up.contiguous(), down.contiguous(), gate_up_scales.contiguous(),
                         down_scales.contiguous(), gate_up_bias, down_bias)  # fmt: skip


def dequantize_expert(experts: ExpertWeights, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's float32 (gate_up [2I, H], down [H, I]) by its format's definition, on the
    weights' device: references and fallbacks, not the kernel's path."""
    return tuple(  # type: ignore[return-value]
        _dequantize(experts.format, w[expert], None if s is None else s[expert])
        for w, s in ((experts.gate_up, experts.gate_up_scale), (experts.down, experts.down_scale))
    )


def _dequantize(fmt: Format, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if fmt == "bf16" or scale is None:
        return w.float()
    if fmt == "fp8":
        return w.float() * scale[:, None]
    if fmt == "fp8_block":
        n, k = w.shape
        return w.float() * scale.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=w.device)
    e2m1 = torch.cat([e2m1, -e2m1])
    values = torch.stack([e2m1[(w & 15).long()], e2m1[(w >> 4).long()]], dim=-1).view(w.shape[0], -1)
    factor = torch.exp2(scale.float() - 127.0).repeat_interleave(MXFP4_BLOCK, 1)
    return values * factor


def _check_shapes(gate_up: tuple[int, ...] | torch.Size, down: tuple[int, ...] | torch.Size,
                  gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None) -> None:  # fmt: skip
    if len(gate_up) != 3 or len(down) != 3 or gate_up[1] % 2:
        raise ValueError(f"expert weights are gate_up [E, 2I, H] and down [E, H, I] (got {tuple(gate_up)} "
                         f"and {tuple(down)})")  # fmt: skip
    e, two_i, h = gate_up
    if tuple(down) != (e, h, two_i // 2):
        raise ValueError(f"down {tuple(down)} does not match gate_up {tuple(gate_up)}: expected {(e, h, two_i // 2)}")
    for name, bias, want in (("gate_up_bias", gate_up_bias, (e, two_i)), ("down_bias", down_bias, (e, h))):
        if bias is not None and tuple(bias.shape) != want:
            raise ValueError(f"{name} is {tuple(bias.shape)}, expected {want}")


def _fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=2) / FP8_MAX).clamp_(min=1e-12)
    q = (w.float() / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def _fp8_per_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    e, n, k = w.shape
    bn, bk = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.zeros(e, bn * FP8_BLOCK, bk * FP8_BLOCK, dtype=torch.float32, device=w.device)
    padded[:, :n, :k] = w
    blocks = padded.view(e, bn, FP8_BLOCK, bk, FP8_BLOCK)
    scale = (blocks.abs().amax(dim=(2, 4)) / FP8_MAX).clamp_(min=1e-12)
    q = (blocks / scale[:, :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).view(e, bn * FP8_BLOCK, bk * FP8_BLOCK)
    return q[:, :n, :k].to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


@dataclass(frozen=True, slots=True)
class Tile:
    """One launch shape of both grouped GEMMs: rows of a block (the experts' padding), output
    columns and inputs per step, and the software pipeline."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


# (largest T, tile). At decode an expert gets a few rows (T * k / E), so blocks of 16 rows
# waste the least MMA work; prefill fills 64-128-row blocks. A starting point for tuning on
# the device: extend or reorder by measurement (bench/moe_kernel_bench.py).
TILES: tuple[tuple[int, Tile], ...] = (
    (64, Tile(16, 64, 128, 4, 4)),
    (512, Tile(32, 64, 128, 4, 3)),
    (2048, Tile(64, 128, 64, 4, 3)),
    (1 << 62, Tile(128, 128, 64, 8, 3)),
)


def tile_for(tokens: int) -> Tile:
    """The tile `fused_moe` runs at `tokens` tokens."""
    return next(tile for bound, tile in TILES if tokens <= bound)


def fused_moe(x: torch.Tensor, experts: ExpertWeights, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              activation: Activation = "silu", tile: Tile | None = None,
              expert_start: int | None = None) -> torch.Tensor:  # fmt: skip
    """out [T, H] (x's dtype) = sum over each token's k experts of its routing weight times
    down(act(gate_up(x))). x [T, H] bf16; topk_ids [T, k] int32 (each in [0, E): not checked
    on the host, which would wait for the device); topk_weights [T, k] float32. `tile`:
    tile_for(T) unless given (tuning). `expert_start`: `experts` are the E experts from
    this global id on (expert parallelism); topk_ids are global, and a pair routed to an
    expert outside them contributes nothing."""
    t, k = topk_ids.shape
    e, h, i = experts.num_experts, experts.hidden, experts.intermediate
    if x.dim() != 2 or x.shape != (t, h):
        raise ValueError(f"x is {tuple(x.shape)}, expected [T, H] = {(t, h)} for topk_ids {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} differs from topk_ids {tuple(topk_ids.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    if experts.format not in FORMATS:
        raise ValueError(f"expert format {experts.format!r} is not one of {FORMATS}")
    tile = tile or tile_for(t)
    if experts.format == "fp8_block" and FP8_BLOCK % tile.block_k:
        raise ValueError(f"fp8_block needs a block_k that divides {FP8_BLOCK} (tile {tile})")
    if experts.format == "mxfp4" and tile.block_k % MXFP4_BLOCK:
        raise ValueError(f"mxfp4 needs a block_k that is a multiple of {MXFP4_BLOCK} (tile {tile})")
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    x, topk_weights = x.contiguous(), topk_weights.to(torch.float32).contiguous()
    pairs = t * k
    sorted_pairs, block_expert = _align(topk_ids, e, tile.block_m, expert_start)
    num_blocks = block_expert.numel()
    fmt = FORMATS.index(experts.format)
    hidden = torch.empty((pairs, i), dtype=torch.bfloat16, device=x.device)
    gu_bias = experts.gate_up_bias
    _gate_up_kernel[(num_blocks * triton.cdiv(i, tile.block_n),)](
        x, experts.gate_up, experts.gate_up_scale, gu_bias, sorted_pairs, block_expert, hidden,
        pairs, i, h, x.stride(0), num_blocks, TOP_K=k, FORMAT=fmt, ACT=ACTIVATIONS.index(activation),
        HAS_BIAS=gu_bias is not None, ALPHA=CLAMPED_SWIGLU_ALPHA, LIMIT=CLAMPED_SWIGLU_LIMIT,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.warps,
        num_stages=tile.stages,
    )  # fmt: skip
    # Pairs routed to another rank's experts are never written: zeros, so they add nothing.
    weighted = (torch.empty if expert_start is None else torch.zeros)((pairs, h), dtype=torch.float32, device=x.device)
    d_bias = experts.down_bias
    _down_kernel[(num_blocks * triton.cdiv(h, tile.block_n),)](
        hidden, experts.down, experts.down_scale, d_bias, topk_weights, sorted_pairs, block_expert, weighted,
        pairs, h, i, num_blocks, FORMAT=fmt, HAS_BIAS=d_bias is not None, BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.warps, num_stages=tile.stages,
    )  # fmt: skip
    return out.copy_(weighted.view(t, k, h).sum(dim=1))


def align_capacity(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted, padded pair list: every pair, plus at most block_m - 1 rows of
    padding for each expert that gets a pair, in whole blocks."""
    rows = pairs + min(num_experts, pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
           expert_start: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(sorted_pairs int32 [capacity], block_expert int32 [capacity / block_m]): see the
    module docstring. Fixed sizes, no host sync."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    computed = num_experts  # the experts whose blocks the kernels run
    if expert_start is not None:  # other ranks' pairs go to one more expert, never run
        local = flat - expert_start
        flat = torch.where((local >= 0) & (local < num_experts), local, num_experts)
        num_experts += 1
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    experts, order = torch.sort(flat, stable=True)
    # a pair's row: its expert's first padded row, plus its rank among that expert's pairs
    rank = torch.arange(pairs, device=flat.device) - (counts.cumsum(0) - counts)[experts]
    rows = (padded_ends - padded)[experts] + rank
    capacity = align_capacity(pairs, num_experts, block_m)
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, rows, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert = torch.where(block_expert < computed, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


if triton is not None:
    _FP8 = tl.constexpr(FORMATS.index("fp8"))
    _FP8_BLOCK = tl.constexpr(FORMATS.index("fp8_block"))
    _MXFP4 = tl.constexpr(FORMATS.index("mxfp4"))
    _SILU = tl.constexpr(ACTIVATIONS.index("silu"))
    # The tiles' dtype into tl.dot: bf16 on the GPU. Triton's interpreter multiplies bf16
    # tiles as their raw 16-bit patterns, so there they go in as float32: the same values
    # (bf16 widens exactly), the same products.
    _DOT = tl.constexpr(tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16)

    @triton.jit
    def _e2m1(code):  # type: ignore[no-untyped-def]
        """4-bit E2M1 codes (sign, two exponent bits of bias 1, one mantissa bit) as float32
        values times 2^-14: the code's bits placed in an fp16's sign, exponent and mantissa
        fields read as that fp16 (0.5 lands on the subnormal 2^-15), widened exactly. Integer
        ops and one conversion an element; the caller folds 2^14 into the block's scale."""
        bits = ((code & 8).to(tl.uint16) << 12) | ((code & 7).to(tl.uint16) << 9)
        return bits.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _dot_mxfp4(acc, a, w_ptr, s_ptr, e, rows, n_ok, k0, N, K, BLOCK_K: tl.constexpr):  # type: ignore[no-untyped-def]
        """The MXFP4 case of _dot_expert. A byte holds inputs 2j (low nibble) and 2j + 1, so
        the tile splits by input parity into two dots of half the depth: the codes never
        interleave, and each byte's scale is its group's (j // 16), read per byte, so no
        register tile changes shape (a reshape or join there costs a trip through shared
        memory)."""
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b_ok = n_ok[:, None] & (offs_b[None, :] < K // 2)
        packed = tl.load(w_ptr + e * N * (K // 2) + rows * (K // 2) + offs_b[None, :], mask=b_ok, other=0)
        groups = K // 32
        scale = tl.load(s_ptr + e * N * groups + rows * groups + (offs_b // 16)[None, :], mask=b_ok, other=127)
        factor = tl.exp2(scale.to(tl.float32) - 113.0)  # 2^(scale - 127), times the 2^14 _e2m1 leaves out
        a_even, a_odd = tl.split(tl.reshape(a, [a.shape[0], BLOCK_K // 2, 2]))
        acc = tl.dot(a_even, tl.trans((_e2m1(packed & 15) * factor).to(_DOT)), acc)
        return tl.dot(a_odd, tl.trans((_e2m1(packed >> 4) * factor).to(_DOT)), acc)

    @triton.jit
    def _dot_expert(  # type: ignore[no-untyped-def]
        acc, a, w_ptr, s_ptr, expert, offs_n, n_ok, k0, N, K,
        FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """acc [BLOCK_M, BLOCK_N] += a [BLOCK_M, BLOCK_K] bf16 @ the expert's weight rows
        offs_n, inputs k0.., dequantized to bf16 in registers (fp8: unscaled, the epilogue
        scales)."""
        e = expert.to(tl.int64)
        rows = offs_n.to(tl.int64)[:, None]
        if FORMAT == _MXFP4:
            acc = _dot_mxfp4(acc, a, w_ptr, s_ptr, e, rows, n_ok, k0, N, K, BLOCK_K)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + e * N * K + rows * K + offs_k[None, :], mask=n_ok[:, None] & (offs_k[None, :] < K),
                        other=0.0)  # fmt: skip
            if FORMAT == _FP8_BLOCK:
                blocks_k = tl.cdiv(K, 128)
                scale = tl.load(s_ptr + e * tl.cdiv(N, 128) * blocks_k + (offs_n // 128) * blocks_k + k0 // 128,
                                mask=n_ok, other=0.0)  # fmt: skip
                acc += tl.dot(a, tl.trans(w.to(_DOT))) * scale[None, :]
            else:
                acc = tl.dot(a, tl.trans(w.to(_DOT)), acc)
        return acc

    @triton.jit
    def _epilogue(acc, s_ptr, b_ptr, expert, offs_n, n_ok, N, FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr):  # type: ignore[no-untyped-def]
        """acc times the per-channel scales (fp8), plus the bias."""
        e = expert.to(tl.int64)
        if FORMAT == _FP8:
            acc = acc * tl.load(s_ptr + e * N + offs_n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + e * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        return acc

    @triton.jit
    def _gate_up_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, s_ptr, b_ptr, sorted_ptr, block_expert_ptr, out_ptr, num_pairs, INTER, K, stride_x, num_blocks,
        TOP_K: tl.constexpr, FORMAT: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, ALPHA: tl.constexpr,
        LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        # row blocks vary fastest: the blocks of one expert read its weight tile one after another
        pid_m = pid % num_blocks
        pid_n = pid // num_blocks
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = pair < num_pairs
        token = (pair // TOP_K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < INTER
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + token[:, None] * stride_x + offs_k[None, :], mask=m_ok[:, None] & (offs_k[None, :] < K),
                        other=0.0).to(_DOT)  # fmt: skip
            gate = _dot_expert(gate, a, w_ptr, s_ptr, expert, offs_n, n_ok, k0, 2 * INTER, K, FORMAT, BLOCK_N, BLOCK_K)
            up = _dot_expert(
                up, a, w_ptr, s_ptr, expert, offs_n + INTER, n_ok, k0, 2 * INTER, K, FORMAT, BLOCK_N, BLOCK_K
            )
        gate = _epilogue(gate, s_ptr, b_ptr, expert, offs_n, n_ok, 2 * INTER, FORMAT, HAS_BIAS)
        up = _epilogue(up, s_ptr, b_ptr, expert, offs_n + INTER, n_ok, 2 * INTER, FORMAT, HAS_BIAS)
        if ACT == _SILU:
            act = gate * tl.sigmoid(gate) * up
        else:
            gate = tl.minimum(gate, LIMIT)
            up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            act = (up + 1.0) * gate * tl.sigmoid(ALPHA * gate)
        o_ptrs = out_ptr + pair.to(tl.int64)[:, None] * INTER + offs_n[None, :]
        tl.store(o_ptrs, act.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _down_kernel(  # type: ignore[no-untyped-def]
        a_ptr, w_ptr, s_ptr, b_ptr, weight_ptr, sorted_ptr, block_expert_ptr, out_ptr, num_pairs, N, K, num_blocks,
        FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        pid_m = pid % num_blocks
        pid_n = pid // num_blocks
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = pair < num_pairs
        rows = pair.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rows[:, None] * K + offs_k[None, :], mask=m_ok[:, None] & (offs_k[None, :] < K),
                        other=0.0).to(_DOT)  # fmt: skip
            acc = _dot_expert(acc, a, w_ptr, s_ptr, expert, offs_n, n_ok, k0, N, K, FORMAT, BLOCK_N, BLOCK_K)
        acc = _epilogue(acc, s_ptr, b_ptr, expert, offs_n, n_ok, N, FORMAT, HAS_BIAS)
        acc = acc * tl.load(weight_ptr + rows, mask=m_ok, other=0.0)[:, None]
        tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
