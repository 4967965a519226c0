"""The fused mixture-of-experts layer on CUDA: every token through its k routed experts in
two grouped-GEMM launches, with the expert weights in bf16, FP8 or MXFP4.

out [T, H] = sum_j topk_weights[t, j] * down_e(act(gate_up_e(x[t]))), e = topk_ids[t, j].

The steps, none of which reads a device value on the host (a step of fixed-size buffers, so
it can be captured in a CUDA graph at each batch size):
1. Align (one Triton program, _align_kernel): the T * k (token, slot) pairs filed by expert,
   each expert's run padded to whole BLOCK_M row blocks; `sorted_pairs` holds pair indices
   (T * k where a row is padding) and `block_expert` each block's expert (-1 past the last
   used block). Both are sized for the worst case, T * k + min(E, T * k) * (BLOCK_M - 1) rows.
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

Both launches compute the transposed product, weights times tokens ([N, K] @ [K, rows]): the
dequantized weight tile is then the MMA's first operand, which Hopper's wgmma takes from
registers; as the second operand it would have to be stored to shared memory every K step,
which serializes the loop. Tokens are the MMA's narrow side, so 16-row blocks at decode
waste none of it.

Formats (`ExpertWeights.format`):
- "bf16": gate_up [E, 2I, H], down [E, H, I] bf16.
- "fp8": e4m3, the same shapes, float32 scales per output channel [E, 2I] and [E, H],
  applied in the epilogue.
- "fp8_block": e4m3 with float32 scales per 128x128 block, [E, ceil(out/128), ceil(in/128)],
  applied to each K step's product (BLOCK_K divides 128).
- "mxfp4": worker/models/mxfp4.py's E2M1 codes and E8M0 scales, rearranged on load (bytes
  moved, no value changed) for the kernel's loads: packed uint8 [E, out, in / 2], where
  byte j of a 32-input group's 16 holds input j in its low nibble and input j + 16 in its
  high one (checkpoints pair inputs 2j and 2j + 1), so each nibble's activations are 16
  contiguous inputs; scales int32 [E, ceil(in / 128), out], byte g of word [w, o] the E8M0
  scale of output o's group 4w + g (zero past the last group). Every kernel load is then
  at least 4 contiguous bytes a thread, which Triton's pipeliner needs to prefetch it: a
  K step of 128 inputs reads one scale word a row (a scale read per byte is not
  prefetched, and stalls each K step).

Tiles are chosen by T from `TILES` (bf16, FP8) or `MXFP4_TILES` (the first whose bound T
does not exceed).

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
    down: torch.Tensor  # [E, H, I]; mxfp4: uint8 [E, H, I / 2] (the module docstring's nibble order)
    # bf16: None; fp8: float32 [E, 2I] / [E, H]; fp8_block: float32 [E, ceil(out / 128),
    # ceil(in / 128)]; mxfp4: int32 words of four E8M0 scales [E, ceil(H / 128), 2I] / [E, ceil(I / 128), H]
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
    _check_shapes((e, two_i, g_h * MXFP4_BLOCK), (e, down_blocks.shape[1], down_blocks.shape[2] * MXFP4_BLOCK),
                  gate_up_bias, down_bias)  # fmt: skip
    if gate_up_interleaved:
        order = torch.cat([torch.arange(0, two_i, 2), torch.arange(1, two_i, 2)]).to(gate_up_blocks.device)
        gate_up_blocks, gate_up_scales = gate_up_blocks[:, order], gate_up_scales[:, order]
        gate_up_bias = None if gate_up_bias is None else gate_up_bias[:, order.to(gate_up_bias.device)]
    return ExpertWeights("mxfp4", _halves_paired(gate_up_blocks), _halves_paired(down_blocks),
                         _scale_words(gate_up_scales), _scale_words(down_scales), gate_up_bias, down_bias)  # fmt: skip


def _halves_paired(blocks: torch.Tensor) -> torch.Tensor:
    """[E, out, G, 16] checkpoint bytes (inputs 2j, 2j + 1 of a group in byte j) -> [E, out,
    G * 16] bytes holding inputs j and j + 16 (the module docstring's order)."""
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # [E, out, G, 32], input order
    paired = codes[..., : MXFP4_BLOCK // 2] | (codes[..., MXFP4_BLOCK // 2 :] << 4)
    return paired.reshape(*blocks.shape[:2], -1).contiguous()


def _scale_words(scales: torch.Tensor) -> torch.Tensor:
    """[E, out, G] E8M0 bytes -> int32 [E, ceil(G / 4), out]: byte g of word w is group 4w + g
    (little-endian, as CUDA and x86 read an int32), groups past G zero."""
    e, out, g = scales.shape
    words = -(-g // 4)
    padded = torch.zeros((e, out, words * 4), dtype=torch.uint8, device=scales.device)
    padded[..., :g] = scales
    return padded.view(e, out, words, 4).permute(0, 2, 1, 3).contiguous().view(torch.int32).view(e, words, out)


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
    groups = w.view(w.shape[0], -1, MXFP4_BLOCK // 2)  # [out, G, 16]: inputs j (low), j + 16 (high)
    values = torch.cat([e2m1[(groups & 15).long()], e2m1[(groups >> 4).long()]], dim=-1).view(w.shape[0], -1)
    words, out = scale.shape
    scale_bytes = scale.contiguous().view(torch.uint8).view(words, out, 4).permute(1, 0, 2).reshape(out, words * 4)
    factor = torch.exp2(scale_bytes[:, : groups.shape[1]].float() - 127.0).repeat_interleave(MXFP4_BLOCK, 1)
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
# MXFP4: K steps of 128 inputs (one scale word a row), or a multiple of them. From the sweep
# in bench/results/moe_mxfp4_ptx_dequant_h200_2026-11-29.txt: 128 weight rows a program from
# 2 tokens up (gpt-oss-20b at T = 8: 217 against 282 us with 64), but 64 at one token, where
# 128 leaves Qwen3-30B-A3B's narrow experts (I = 768) too few programs (55 against 36 us).
MXFP4_TILES: tuple[tuple[int, Tile], ...] = (
    (1, Tile(16, 64, 128, 4, 3)),
    (64, Tile(16, 128, 128, 4, 3)),
    (512, Tile(64, 64, 128, 4, 4)),
    (1 << 62, Tile(128, 64, 128, 4, 3)),
)
MXFP4_STEP = 128  # inputs per scale word


def tile_for(tokens: int, format: Format = "bf16") -> Tile:
    """The tile `fused_moe` runs at `tokens` tokens for experts in `format`."""
    return next(tile for bound, tile in (MXFP4_TILES if format == "mxfp4" else TILES) if tokens <= bound)


def fused_moe(x: torch.Tensor, experts: ExpertWeights, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              activation: Activation = "silu", tile: Tile | None = None,
              expert_start: int | None = None) -> torch.Tensor:  # fmt: skip
    """out [T, H] (x's dtype) = sum over each token's k experts of its routing weight times
    down(act(gate_up(x))). x [T, H] bf16; topk_ids [T, k] int32 (each in [0, E): not checked
    on the host, which would wait for the device); topk_weights [T, k] float32. `tile`:
    tile_for(T, experts.format) unless given (tuning). `expert_start`: `experts` are the E
    experts from this global id on (expert parallelism); topk_ids are global, and a pair
    routed to an expert outside them contributes nothing."""
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
    tile = tile or tile_for(t, experts.format)
    if experts.format == "fp8_block" and FP8_BLOCK % tile.block_k:
        raise ValueError(f"fp8_block needs a block_k that divides {FP8_BLOCK} (tile {tile})")
    if experts.format == "mxfp4" and tile.block_k % MXFP4_STEP:
        raise ValueError(f"mxfp4 needs a block_k that is a multiple of {MXFP4_STEP} (tile {tile})")
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
    module docstring. One program of _align_kernel: a decode step's few pairs would
    otherwise pay a dozen torch launches (count, scan, sort, scatter, search) a layer."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    pairs = ids.numel()
    sorted_experts = num_experts + (expert_start is not None)  # other ranks' pairs: one more, never run
    capacity = align_capacity(pairs, sorted_experts, block_m)
    bins = triton.next_power_of_2(sorted_experts)
    sorted_pairs = torch.empty((capacity,), dtype=torch.int32, device=ids.device)
    block_expert = torch.empty((capacity // block_m,), dtype=torch.int32, device=ids.device)
    cursors = torch.empty((2 * bins,), dtype=torch.int32, device=ids.device)
    _align_kernel[(1,)](
        ids, sorted_pairs, block_expert, cursors, pairs, capacity // block_m, expert_start or 0, num_experts,
        HAS_START=expert_start is not None, BLOCK_M=block_m, BINS=bins, CHUNK=1024, BLOCK_CHUNK=max(16, 4096 // bins),
        num_warps=8,
    )  # fmt: skip
    return sorted_pairs, block_expert


if triton is not None:
    _BF16 = tl.constexpr(FORMATS.index("bf16"))
    _FP8 = tl.constexpr(FORMATS.index("fp8"))
    _FP8_BLOCK = tl.constexpr(FORMATS.index("fp8_block"))
    _MXFP4 = tl.constexpr(FORMATS.index("mxfp4"))
    _SILU = tl.constexpr(ACTIVATIONS.index("silu"))
    _INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
    # The tiles' dtype into tl.dot: bf16 on the GPU. Triton's interpreter multiplies bf16
    # tiles as their raw 16-bit patterns, so there they go in as float32: the same values
    # (bf16 widens exactly), the same products.
    _DOT = tl.constexpr(tl.float32 if _INTERPRETED else tl.bfloat16)
    # Inline PTX on the GPU; the interpreter, which runs no PTX, takes the same formula in
    # Triton's operations.
    _PTX = tl.constexpr(not _INTERPRETED)

    @triton.jit
    def _sorted_expert(ids_ptr, offs, ok, expert_start, num_experts, HAS_START: tl.constexpr):  # type: ignore[no-untyped-def]
        """The expert a pair is sorted under: its id, or (expert parallelism) its local id,
        with other ranks' pairs under num_experts."""
        expert = tl.load(ids_ptr + offs, mask=ok, other=0)
        if HAS_START:
            local = expert - expert_start
            expert = tl.where((local >= 0) & (local < num_experts), local, num_experts)
        return expert

    @triton.jit
    def _align_kernel(  # type: ignore[no-untyped-def]
        ids_ptr, sorted_ptr, block_expert_ptr, cursor_ptr, num_pairs, num_blocks, expert_start, num_experts,
        HAS_START: tl.constexpr, BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr,
        BLOCK_CHUNK: tl.constexpr,
    ):  # fmt: skip
        """One program: count the pairs per expert (atomics into cursor_ptr[:BINS]), pad each
        count to whole blocks and scan, then file each pair at its expert's next free row
        (atomics into cursor_ptr[BINS:]); then each block's expert and its padding rows.
        Within an expert the rows' order is the atomics', which varies from run to run: a
        row's result does not depend on its place in the tile, and step 4 sums by pair."""
        bins = tl.arange(0, BINS)
        tl.store(cursor_ptr + bins, tl.zeros([BINS], dtype=tl.int32))
        tl.debug_barrier()
        for p0 in range(0, num_pairs, CHUNK):
            offs = p0 + tl.arange(0, CHUNK)
            ok = offs < num_pairs
            tl.atomic_add(cursor_ptr + _sorted_expert(ids_ptr, offs, ok, expert_start, num_experts, HAS_START), 1,
                          mask=ok)  # fmt: skip
        tl.debug_barrier()
        counts = tl.load(cursor_ptr + bins, volatile=True)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        starts = ends - padded
        tl.store(cursor_ptr + BINS + bins, starts)
        tl.debug_barrier()
        for p0 in range(0, num_pairs, CHUNK):
            offs = p0 + tl.arange(0, CHUNK)
            ok = offs < num_pairs
            expert = _sorted_expert(ids_ptr, offs, ok, expert_start, num_experts, HAS_START)
            row = tl.atomic_add(cursor_ptr + BINS + expert, 1, mask=ok)
            tl.store(sorted_ptr + row, offs, mask=ok)
        for b0 in range(0, num_blocks, BLOCK_CHUNK):
            blocks = b0 + tl.arange(0, BLOCK_CHUNK)
            first = blocks * BLOCK_M
            # the block's expert: how many padded runs end at or before its first row (BINS
            # past the last run, where it matches no bin: no pairs, all padding)
            owner = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), 1)
            mine = bins[None, :] == owner[:, None]
            start = tl.sum(tl.where(mine, starts[None, :], 0), 1)
            count = tl.sum(tl.where(mine, counts[None, :], 0), 1)
            b_ok = blocks < num_blocks
            tl.store(block_expert_ptr + blocks, tl.where(owner < num_experts, owner, -1), mask=b_ok)
            rows = first[:, None] + tl.arange(0, BLOCK_M)[None, :]
            tl.store(sorted_ptr + rows, tl.full(rows.shape, 0, tl.int32) + num_pairs,
                     mask=b_ok[:, None] & (rows - start[:, None] >= count[:, None]))  # fmt: skip

    # bf16 2^126: E2M1's three magnitude bits placed in bf16's lowest two exponent bits and top
    # mantissa bit read as 2^(e - 127) * (1 + m / 2) (e > 0) or 2^-126 * m / 2 (e = 0, a
    # subnormal); times 2^126 that is E2M1's 2^(e - 1) * (1 + m / 2) and m / 2, exactly.
    _E2M1_REBIAS = tl.constexpr(2.0**126)

    @triton.jit
    def _e2m1_pairs(packed, scale):  # type: ignore[no-untyped-def]
        """Bytes of two E2M1 codes (sign, two exponent bits of bias 1, one mantissa bit) times
        their block's scale `scale` (bf16 2^(s - 127), broadcast), as bf16: (the low nibbles',
        the high nibbles'). Each code's bits are moved into a bf16's fields, then two exact
        multiplies (2^126, the scale). On the GPU, in PTX for two bytes (four codes) a call:
        prmt's sign-replicating byte select puts each byte in its own half-word with the
        byte's top bit (the high code's sign) copied up to bit 15, one shift and one mask
        leave sign and magnitude in place, and bf16x2 multiplies finish: 12 instructions for
        four weights, where Triton's element-wise integer operations took about 13 a weight
        and bounded the kernel (its SASS: bench/results/moe_mxfp4_ptx_dequant_h200_2026-11-29.txt).
        Exact for scales 2^-126 .. 2^125 (s 1 .. 252), which hold every trained weight."""
        if _PTX:
            return tl.inline_asm_elementwise(
                """{
                .reg .b32 low, t0, t1, rebias;
                mov.b32 rebias, 0x7E807E80;
                shl.b32 low, $2, 4;
                prmt.b32 t0, low, low, 0x9180;
                prmt.b32 t1, $2, $2, 0x9180;
                shl.b32 t0, t0, 2;
                shl.b32 t1, t1, 2;
                and.b32 t0, t0, 0x81C081C0;
                and.b32 t1, t1, 0x81C081C0;
                mul.rn.bf16x2 t0, t0, rebias;
                mul.rn.bf16x2 t1, t1, rebias;
                mul.rn.bf16x2 $0, t0, $3;
                mul.rn.bf16x2 $1, t1, $3;
                }""",
                "=r,=r,r,r", [packed, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2,
            )  # fmt: skip
        # The same bits as the top half of a float32 (the interpreter flushes bf16 subnormals).
        c = packed.to(tl.int32)
        lo = ((((c & 7) << 6) | ((c & 8) << 12)) << 16).to(tl.float32, bitcast=True)
        hi = ((((c & 0x70) << 2) | ((c & 0x80) << 8)) << 16).to(tl.float32, bitcast=True)
        factor = scale.to(tl.float32) * _E2M1_REBIAS
        return (lo * factor).to(_DOT), (hi * factor).to(_DOT)

    @triton.jit
    def _e4m3_bf16(w):  # type: ignore[no-untyped-def]
        """E4M3 codes as the dots' dtype (bf16 on the GPU), exactly. On the GPU in PTX, two codes
        a call: as `_e2m1_pairs`, each byte into its own half-word with its sign replicated, its
        exponent and mantissa bits shifted into bf16's lowest four exponent bits and top three
        mantissa bits, and one bf16x2 multiply by 2^120 (the two formats' exponent biases apart;
        codes of exponent 0 are bf16 subnormals until then): four full-rate instructions for two
        weights, where Triton's conversion takes three conversion-unit instructions for two
        (e4m3 pair to f16 pair, then each f16 to bf16), which issue at a fraction of the
        integer rate."""
        if _PTX:
            return tl.inline_asm_elementwise(
                """{
                .reg .b32 t, rebias;
                mov.b32 rebias, 0x7B807B80;
                prmt.b32 t, $1, $1, 0x9180;
                shl.b32 t, t, 4;
                and.b32 t, t, 0x87F087F0;
                mul.rn.bf16x2 $0, t, rebias;
                }""",
                "=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=2,
            )  # fmt: skip
        return w.to(_DOT)

    @triton.jit
    def _load_rows(a_ptr, rows, stride, m_ok, k0, K, WIDTH: tl.constexpr):  # type: ignore[no-untyped-def]
        """The activation rows' inputs k0 .. k0 + WIDTH - 1: [BLOCK_M, WIDTH]."""
        offs = k0 + tl.arange(0, WIDTH)
        ptrs = a_ptr + rows[:, None] * stride + offs[None, :]
        return tl.load(ptrs, mask=m_ok[:, None] & (offs[None, :] < K), other=0.0).to(_DOT)

    @triton.jit
    def _dot_dense(  # type: ignore[no-untyped-def]
        acc, a, w_ptr, s_ptr, expert, offs_n, n_ok, k0, N, K, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """acc [BLOCK_N, BLOCK_M] += the expert's weight rows offs_n, inputs k0.. (bf16, or e4m3
        widened to bf16 in registers, unscaled: the epilogue scales "fp8") @ a^T (the
        transposed product: see the module docstring)."""
        e = expert.to(tl.int64)
        rows = offs_n.to(tl.int64)[:, None]
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + e * N * K + rows * K + offs_k[None, :], mask=n_ok[:, None] & (offs_k[None, :] < K),
                    other=0.0)  # fmt: skip
        w = w.to(_DOT) if FORMAT == _BF16 else _e4m3_bf16(w)
        if FORMAT == _FP8_BLOCK:
            blocks_k = tl.cdiv(K, 128)
            scale = tl.load(s_ptr + e * tl.cdiv(N, 128) * blocks_k + (offs_n // 128) * blocks_k + k0 // 128,
                            mask=n_ok, other=0.0)  # fmt: skip
            return acc + tl.dot(w, tl.trans(a)) * scale[:, None]
        return tl.dot(w, tl.trans(a), acc)

    @triton.jit
    def _scale_word(s_ptr, expert, offs_n, n_ok, k0, N, K):  # type: ignore[no-untyped-def]
        """The rows' scale words for inputs k0 .. k0 + 127 (four groups a word): int32 [BLOCK_N]."""
        words = (K // 32 + 3) // 4
        in_k = (k0 + tl.zeros_like(offs_n)) < K  # a tile's last K step may start past K
        ptrs = s_ptr + expert.to(tl.int64) * words * N + (k0 // 128) * N + offs_n.to(tl.int64)
        return tl.load(ptrs, mask=n_ok & in_k, other=0)

    @triton.jit
    def _dot_mxfp4(acc, lo, hi, w_ptr, scale, expert, offs_n, n_ok, k0, N, K):  # type: ignore[no-untyped-def]
        """acc [BLOCK_N, BLOCK_M] += one 32-input group (inputs k0 ..) of the expert's MXFP4 rows
        offs_n, of E8M0 scales `scale` [BLOCK_N], @ its activations: lo, hi [BLOCK_M, 16]
        (inputs k0 .., k0 + 16 ..: the low and high nibbles', see the module docstring). One
        scale a row, applied in the dequantization: no tile changes shape."""
        e = expert.to(tl.int64)
        offs_b = k0 // 2 + tl.arange(0, 16)
        ok = n_ok[:, None] & (offs_b[None, :] < K // 2)
        packed = tl.load(w_ptr + e * N * (K // 2) + offs_n.to(tl.int64)[:, None] * (K // 2) + offs_b[None, :], mask=ok,
                         other=0)  # fmt: skip
        factor = (scale << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)[:, None]  # 2^(s - 127)
        w_lo, w_hi = _e2m1_pairs(packed, factor)
        acc = tl.dot(w_lo, tl.trans(lo), acc)
        return tl.dot(w_hi, tl.trans(hi), acc)

    @triton.jit
    def _epilogue(acc, s_ptr, b_ptr, expert, offs_n, n_ok, N, FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr):  # type: ignore[no-untyped-def]
        """acc [BLOCK_N, BLOCK_M] times the per-channel scales (fp8), plus the bias."""
        e = expert.to(tl.int64)
        if FORMAT == _FP8:
            acc = acc * tl.load(s_ptr + e * N + offs_n, mask=n_ok, other=0.0)[:, None]
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + e * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
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
        gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if FORMAT == _MXFP4:
                for w in tl.static_range(0, BLOCK_K, 128):
                    gate_word = _scale_word(s_ptr, expert, offs_n, n_ok, k0 + w, 2 * INTER, K)
                    up_word = _scale_word(s_ptr, expert, offs_n + INTER, n_ok, k0 + w, 2 * INTER, K)
                    for g in tl.static_range(4):
                        kg = k0 + w + 32 * g
                        lo = _load_rows(x_ptr, token, stride_x, m_ok, kg, K, 16)
                        hi = _load_rows(x_ptr, token, stride_x, m_ok, kg + 16, K, 16)
                        gate = _dot_mxfp4(gate, lo, hi, w_ptr, (gate_word >> (8 * g)) & 255, expert, offs_n, n_ok, kg,
                                          2 * INTER, K)  # fmt: skip
                        up = _dot_mxfp4(up, lo, hi, w_ptr, (up_word >> (8 * g)) & 255, expert, offs_n + INTER, n_ok,
                                        kg, 2 * INTER, K)  # fmt: skip
            else:
                a = _load_rows(x_ptr, token, stride_x, m_ok, k0, K, BLOCK_K)
                gate = _dot_dense(gate, a, w_ptr, s_ptr, expert, offs_n, n_ok, k0, 2 * INTER, K, FORMAT, BLOCK_K)
                up = _dot_dense(up, a, w_ptr, s_ptr, expert, offs_n + INTER, n_ok, k0, 2 * INTER, K, FORMAT, BLOCK_K)
        gate = _epilogue(gate, s_ptr, b_ptr, expert, offs_n, n_ok, 2 * INTER, FORMAT, HAS_BIAS)
        up = _epilogue(up, s_ptr, b_ptr, expert, offs_n + INTER, n_ok, 2 * INTER, FORMAT, HAS_BIAS)
        if ACT == _SILU:
            act = gate * tl.sigmoid(gate) * up
        else:
            gate = tl.minimum(gate, LIMIT)
            up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            act = (up + 1.0) * gate * tl.sigmoid(ALPHA * gate)
        o_ptrs = out_ptr + pair.to(tl.int64)[:, None] * INTER + offs_n[None, :]
        tl.store(o_ptrs, tl.trans(act).to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

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
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if FORMAT == _MXFP4:
                for w in tl.static_range(0, BLOCK_K, 128):
                    word = _scale_word(s_ptr, expert, offs_n, n_ok, k0 + w, N, K)
                    for g in tl.static_range(4):
                        kg = k0 + w + 32 * g
                        lo = _load_rows(a_ptr, rows, K, m_ok, kg, K, 16)
                        hi = _load_rows(a_ptr, rows, K, m_ok, kg + 16, K, 16)
                        acc = _dot_mxfp4(acc, lo, hi, w_ptr, (word >> (8 * g)) & 255, expert, offs_n, n_ok, kg, N, K)
            else:
                a = _load_rows(a_ptr, rows, K, m_ok, k0, K, BLOCK_K)
                acc = _dot_dense(acc, a, w_ptr, s_ptr, expert, offs_n, n_ok, k0, N, K, FORMAT, BLOCK_K)
        acc = _epilogue(acc, s_ptr, b_ptr, expert, offs_n, n_ok, N, FORMAT, HAS_BIAS)
        acc = acc * tl.load(weight_ptr + rows, mask=m_ok, other=0.0)[None, :]
        tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], tl.trans(acc), mask=m_ok[:, None] & n_ok[None, :])
