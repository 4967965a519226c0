"""Quantized linear layers of the torch backend on CUDA: what `TorchDecoderOps.linear_weight`
makes from a quantized checkpoint's weights (worker.models.quantization) or quantizes from
float weights on the device, and the GEMMs `linear` runs on them.

- `Fp8Linear`: e4m3 weights with per-output-channel scales; activations quantized per
  token (one Triton pass per row: amax, scale, cast, or the codes the norm / SwiGLU kernel
  that made the input wrote beside it) or with the checkpoint's static scale, then one
  `torch._scaled_mm` (cuBLASLt FP8, row-wise scales, bf16 out), or the Triton FP8 GEMM at
  the row counts where it was timed faster (fp8_gemm.py: the decode graphs' and the full
  prefill chunk's), or at one row the GEMV (gemv.py) on the codes.
- `Int4Linear`: W4A16. Weights packed eight to an int32 along the input dimension,
  [in // 8, out], so that a tile of consecutive inputs for a run of outputs is one
  coalesced load; scales (and zero points) per group as float32 [groups, out], a
  checkpoint's integer zeros and on load's float ones alike. Groups are a multiple of 16
  inputs. Triton kernels dequantize in registers and accumulate in float32. Batch 1
  (decode at low load, bound by reading the weights once) has a GEMV kernel of its own:
  each word is loaded once and its eight nibbles unpacked in registers (one LOP3 and one
  FFMA a weight, `_int4_tile_dot`), with no 16-row MMA padding, and the input dimension is
  split over programs so that every SM streams weights; the last program of a column tile
  adds up the splits' partial sums in split order (reproducible), so a call is one launch.
  Its tiles of 64 inputs hold whole groups when they are smaller (on load's 32: two), each
  summed and scaled apart, so small groups keep the long loads. Larger batches take the
  tiled kernel (16-128 row tiles, tl.dot over 64 inputs, or the group when smaller).

On the CPU the backend does not come here: it computes with the dequantized reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.backends import fp8_gemm, gemv, pdl
from worker.backends.sm_count import num_sms
from worker.models.quantization import FP8_MAX, INT4_GROUP_SIZE, Fp8Weight, Int4Weight, QuantizedWeight

try:
    import triton  # type: ignore[import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # the CPU host
    triton = None

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True, slots=True)
class Fp8Linear:
    weight: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [1, out]
    input_scale: torch.Tensor | None  # float32 [1, 1], static; None: per token at run time
    bias: torch.Tensor | None  # [out], compute dtype
    # Row counts whose product runs the Triton GEMM, and its tile: in the decode graphs, and
    # in eager steps (full prefill chunks); other row counts run cuBLAS. Filled in when the KV
    # cache is allocated (TorchBackend.tune_gemms).
    graph_tiles: dict[int, fp8_gemm.Tile] = field(default_factory=dict)
    eager_tiles: dict[int, fp8_gemm.Tile] = field(default_factory=dict)

    def __call__(self, x: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`quantized`: x's per-token e4m3 codes and scales, when the kernel that made x
        wrote them too (torch_ops.add_rmsnorm_fp8_triton); used with dynamic scales only."""
        if self.input_scale is None:
            xq, x_scale = quantized or quantize_rows_fp8(x)
        else:
            xq = (x.float() / self.input_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
            x_scale = self.input_scale.expand(x.shape[0], 1).contiguous()
        if x.shape[0] == 1 and x.is_cuda and triton is not None:
            return gemv.gemv(xq, self.weight, self.bias, out_dtype=x.dtype, scales=(x_scale, self.scale))
        # Graph and eager choices apart: an eager step at a graph's row count runs cuBLAS, as
        # it did before the graphs' row counts were timed.
        tiles = self.graph_tiles if torch.cuda.is_current_stream_capturing() else self.eager_tiles
        tile = tiles.get(x.shape[0])
        if tile is not None:
            out = fp8_gemm.fp8_matmul(xq, x_scale, self.weight, self.scale, x.dtype, tile)
        else:
            out = fp8_gemm.scaled_mm(xq, x_scale, self.weight, self.scale, x.dtype)
        # The bias is added apart: not every torch's row-wise _scaled_mm takes one.
        return out if self.bias is None else out + self.bias


@dataclass(frozen=True, slots=True)
class Int4Linear:
    qweight: torch.Tensor  # int32 [in // 8, out]: nibble j of row r holds input 8r + j, as q + 8
    scale: torch.Tensor  # float32 [in // group_size, out]
    zero: torch.Tensor | None  # float32 [in // group_size, out]; None: symmetric
    group_size: int
    bias: torch.Tensor | None  # [out], compute dtype
    # The batch-1 kernel's split-K partial sums (a row per split) and per-tile counters (zero
    # between calls); one set per layer, so layers never share them (each is allocated
    # outside graph capture): 0.5-1.8 MB a projection at the 8B's shapes.
    split_sums: torch.Tensor  # float32 [SPLIT_K, out]
    split_counts: torch.Tensor  # int32 [ceil(out / GEMV_BLOCK_N)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and x.is_cuda:
            out = w4a16_gemv(x, self)
        else:
            out = w4a16_matmul(x, self.qweight, self.scale, self.zero, self.group_size)
        return out if self.bias is None else out + self.bias


GEMV_BLOCK_N = 512
# Four programs of four warps an SM in one wave: 128 registers a thread at most (ptxas gave
# the kernel 136, three programs an SM).
GEMV_PROGRAMS_PER_SM, GEMV_MAX_REGISTERS = 4, 128


def int4_linear(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int,
                bias: torch.Tensor | None) -> Int4Linear:  # fmt: skip
    if group_size % 16:  # the tiled kernel's tl.dot takes tiles of 16 inputs or more, inside a group
        raise ValueError(f"the W4A16 kernels take int4 groups of a multiple of 16 inputs, got {group_size}")
    out = qweight.shape[1]
    split, _, _ = _gemv_split(out, qweight.shape[0] * 8, group_size, num_sms(qweight.device))
    sums = torch.zeros((split, out), dtype=torch.float32, device=qweight.device)
    counts = torch.zeros(-(-out // GEMV_BLOCK_N), dtype=torch.int32, device=qweight.device)
    return Int4Linear(qweight, scale, zero, group_size, bias, sums, counts)


@dataclass(frozen=True, slots=True)
class Fp8Reference:
    """FP8 on the CPU: the dequantized weight, and inputs rounded to e4m3 the way
    Fp8Linear rounds them on the GPU (what worker.models.quantization.fake_quantize_inputs
    does in numpy)."""

    weight: torch.Tensor  # float32 [out, in], dequantized
    bias: torch.Tensor | None
    input_scale: float | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is None:
            scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=1e-12)
        else:
            scale = torch.tensor(self.input_scale, dtype=x.dtype)
        xq = (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype) * scale
        return torch.nn.functional.linear(xq, self.weight, self.bias)


QuantLinear = Fp8Linear | Int4Linear | Fp8Reference


# -- weights ----------------------------------------------------------------------------------


def quantized_linear(
    parts: Sequence[QuantizedWeight | torch.Tensor | np.ndarray],
    bias: torch.Tensor | None,
    mode: str | None,
    device: torch.device,
) -> QuantLinear:
    """One fused projection from its row blocks: a checkpoint's quantized weights as they
    are, or float ones quantized here on the device by `mode` ("fp8" | "int4")."""
    if all(isinstance(p, Fp8Weight) for p in parts):
        return _fp8_from_checkpoint([p for p in parts if isinstance(p, Fp8Weight)], bias, device)
    if all(isinstance(p, Int4Weight) for p in parts):
        return _int4_from_checkpoint([p for p in parts if isinstance(p, Int4Weight)], bias, device)
    if any(isinstance(p, Fp8Weight | Int4Weight) for p in parts):
        raise ValueError("a fused projection mixes quantized and float parts")
    w = torch.cat([torch.as_tensor(p).to(device=device, dtype=torch.float32) for p in parts])
    if mode == "fp8":
        return quantize_fp8(w, bias)
    if mode == "int4":
        return quantize_int4(w, bias)
    raise ValueError(f"quantization must be 'fp8' or 'int4', got {mode!r}")


def quantize_fp8(w: torch.Tensor, bias: torch.Tensor | None) -> Fp8Linear:
    """Per-output-channel e4m3, as worker.models.quantization.quantize_fp8 does."""
    scale = w.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Linear(codes, scale[None, :].contiguous(), None, bias)


def quantize_int4(w: torch.Tensor, bias: torch.Tensor | None, group_size: int = INT4_GROUP_SIZE,
                  symmetric: bool = False) -> Int4Linear:  # fmt: skip
    """Group-wise RTN, as worker.models.quantization.quantize_int4 does: asymmetric with a
    float zero (min and max on the grid) by default, or symmetric (amax / 7, no zero)."""
    out, n_in = w.shape
    if n_in % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide the layer's {n_in} inputs")
    groups = w.view(out, n_in // group_size, group_size)
    lo = groups.amin(dim=2)
    scale = groups.abs().amax(dim=2) / 7.0 if symmetric else (groups.amax(dim=2) - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = None if symmetric else -8.0 - lo / scale
    shifted = groups / scale[:, :, None] + (0.0 if zero is None else zero[:, :, None])
    q = torch.round(shifted).clamp_(-8, 7).to(torch.int32).view(out, n_in)
    return int4_linear(_pack_along_in(q.t()), scale.t().contiguous(), None if zero is None else zero.t().contiguous(),
                       group_size, bias)  # fmt: skip


def _pack_along_in(q_in_out: torch.Tensor) -> torch.Tensor:
    """int values [in, out] in [-8, 7] -> int32 [in // 8, out], input 8r + j in nibble j."""
    n_in, out = q_in_out.shape
    u = (q_in_out.to(torch.int64) + 8).reshape(n_in // 8, 8, out)
    words = torch.zeros((n_in // 8, out), dtype=torch.int64, device=q_in_out.device)
    for j in range(8):
        words |= u[:, j, :] << (4 * j)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _unpack_along_in(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, in // 8] (compressed-tensors: along the last dim) -> int [rows, in] in [-8, 7]."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    u = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=-1)
    return u.view(packed.shape[0], -1) - 8


def _fp8_from_checkpoint(parts: list[Fp8Weight], bias: torch.Tensor | None, device: torch.device) -> Fp8Linear:
    codes = torch.from_numpy(np.concatenate([p.codes for p in parts])).to(device).view(FP8)
    scale = torch.from_numpy(np.concatenate([p.scale for p in parts])).to(device)
    statics = [p.input_scale for p in parts]
    # Fused parts share one activation; its static scale is the largest (no part clips).
    input_scale = None if None in statics else torch.tensor([[max(s for s in statics if s is not None)]])
    return Fp8Linear(codes, scale[None, :].contiguous(), None if input_scale is None else input_scale.to(device),
                     bias)  # fmt: skip


def _int4_from_checkpoint(parts: list[Int4Weight], bias: torch.Tensor | None, device: torch.device) -> Int4Linear:
    group_size = parts[0].group_size
    if any(p.group_size != group_size for p in parts):
        raise ValueError("fused int4 parts have different group sizes")
    q = _unpack_along_in(torch.from_numpy(np.concatenate([p.packed for p in parts])).to(device))  # [out, in]
    scale = torch.from_numpy(np.concatenate([p.scale for p in parts])).to(device)  # [out, groups]
    zero = None
    if any(p.zero is not None for p in parts):
        zeros = [np.zeros(p.scale.shape, np.int8) if p.zero is None else p.zero for p in parts]
        zero = torch.from_numpy(np.concatenate(zeros)).to(device=device, dtype=torch.float32).t().contiguous()
    return int4_linear(_pack_along_in(q.t()), scale.t().contiguous(), zero, group_size, bias)


# -- activations: per-token FP8 -----------------------------------------------------------------


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]) with scale = row amax / 448."""
    m, k = x.shape
    if triton is None or not x.is_cuda:
        scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=1e-12)
        return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _quant_rows_kernel[(m,)](x, q, scale, k, x.stride(0), BLOCK=block, num_warps=min(16, max(1, block // 512)))
    return q, scale


if triton is not None:

    @triton.jit  # type: ignore[misc,unused-ignore]
    def store_fp8_row(y, q_ptrs, s_ptr, ok):  # type: ignore[no-untyped-def]
        """A row's per-token e4m3 codes and scale (row amax / 448), from float32 values
        in registers: the row quantization of every FP8 projection's input, here and in
        the norm / SwiGLU kernels that write it beside their output (torch_ops.py)."""
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / 448.0, 1e-12)
        q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
        tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=ok)
        tl.store(s_ptr, scale)

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        # One row per program, read once: amax, scale and cast from registers.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        store_fp8_row(x, q_ptr + row * K + offs, s_ptr + row, mask)

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _w4a16_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_x, stride_out, group_size,
        HAS_ZERO: tl.constexpr, SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = offs_m < M, offs_n < N
        k_span = K // SPLIT_K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_k * k_span, (pid_k + 1) * k_span, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :], mask=m_ok[:, None],
                        other=0.0)  # fmt: skip
            # Each int32 holds 8 consecutive inputs: the 8 rows that share it load it
            # once from DRAM (the rest hit L1), then shift their own nibble out.
            words = tl.load(w_ptr + (offs_k[:, None] // 8).to(tl.int64) * N + offs_n[None, :], mask=n_ok[None, :],
                            other=0)  # fmt: skip
            q = ((words >> ((offs_k[:, None] % 8) * 4)) & 0xF).to(tl.float32) - 8.0
            g = k0 // group_size  # BLOCK_K divides the group size: one group per tile
            s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)
            if HAS_ZERO:
                q -= tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0)[None, :]
            w = (q * s[None, :]).to(x.dtype)
            acc += tl.dot(x, w)
        # Split K: each split's partial sums go to a plane of their own, added up in a fixed
        # order afterwards, so that a product (and a greedy run over it) is reproducible.
        plane = out_ptr + pid_k.to(tl.int64) * M * stride_out
        out = plane + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


if triton is not None:
    from worker.backends.pdl import wait as pdl_wait

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _nibble(src, mask: tl.constexpr, exponent: tl.constexpr):  # type: ignore[no-untyped-def]
        """The nibble of `src` under `mask` as the low bits of a float's mantissa: with the
        exponent bits chosen, 2048 + n (mask 0xF000) or 128 + n (mask 0xF0000), exactly."""
        return ((src & mask) | exponent).to(tl.float32, bitcast=True)

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _int4_tile_dot(  # type: ignore[no-untyped-def]
        words, x_ptr, k0, s_ptr, z_ptr, offs_n, n_ok, N, group_size,
        HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GROUPS: tl.constexpr,
    ):  # fmt: skip
        """One tile: x[k0 : k0 + 8 BLOCK_KW] . dequantized W[that, offs_n] -> [BLOCK_N] float32.

        A weight costs one LOP3 and one FFMA: its nibble is masked in place into the
        mantissa of a float whose exponent makes it 2048 + n or 128 + n (bits 12-15 or
        16-19), and x times that is accumulated; the offsets (x * (2048 + 8) or x * (128 + 8),
        the +8 being the storage bias) are summed per row, once for all columns, and taken
        off per group. Each word is shifted three times to bring its eight nibbles, two at a
        time, under the two masks. The offsets cost precision: a product's rounding is
        2^-24 of x * 2048, about 1e-4 of a group's sum, well inside bf16's 4e-3. Unpacking with
        variable shifts and int-to-float conversions took 6.2-6.6 SASS instructions a weight in
        the loop against 4.5-5.1 here (ptxas, sm_90), and the 8B's four batch-1 projections
        89 us against 73 on the H100 (bench/results/int4_gemv_sweep_h100_2026-11-27.txt)."""
        rows = tl.arange(0, BLOCK_KW)  # word rows: inputs 8r .. 8r + 7
        xp = x_ptr + k0 + rows * 8
        u = words.to(tl.uint32, bitcast=True)
        lo, hi = u << 8, u >> 8
        rot = (u << 16) | (u >> 16)
        x0, x1 = tl.load(xp).to(tl.float32), tl.load(xp + 1).to(tl.float32)
        x2, x3 = tl.load(xp + 2).to(tl.float32), tl.load(xp + 3).to(tl.float32)
        x4, x5 = tl.load(xp + 4).to(tl.float32), tl.load(xp + 5).to(tl.float32)
        x6, x7 = tl.load(xp + 6).to(tl.float32), tl.load(xp + 7).to(tl.float32)
        # nibble j of a word: 3, 4 in place; 1, 2 after << 8; 5, 6 after >> 8; 7, 0 rotated
        per_row = _nibble(u, 0xF000, 0x45000000) * x3[:, None]
        per_row += _nibble(u, 0xF0000, 0x43000000) * x4[:, None]
        per_row += _nibble(lo, 0xF000, 0x45000000) * x1[:, None]
        per_row += _nibble(lo, 0xF0000, 0x43000000) * x2[:, None]
        per_row += _nibble(hi, 0xF000, 0x45000000) * x5[:, None]
        per_row += _nibble(hi, 0xF0000, 0x43000000) * x6[:, None]
        per_row += _nibble(rot, 0xF000, 0x45000000) * x7[:, None]
        per_row += _nibble(rot, 0xF0000, 0x43000000) * x0[:, None]
        odd, even = x1 + x3 + x5 + x7, x0 + x2 + x4 + x6
        offset = odd * 2056.0 + even * 136.0  # [KW]: sum of x (2048 + 8) and x (128 + 8)
        if GROUPS == 1:  # BLOCK_KW * 8 divides the group size: one group per tile
            part = tl.sum(per_row, axis=0) - tl.sum(offset, axis=0)
            g = k0 // group_size
            if HAS_ZERO:  # sum x (q - z) = sum x q - z sum x
                part -= tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0) * tl.sum(odd + even, axis=0)
            return part * tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)
        # GROUPS whole groups per tile: sum each group's rows, then scale it
        part = tl.sum(tl.reshape(per_row, (GROUPS, BLOCK_KW // GROUPS, BLOCK_N)), axis=1)  # [G, N]
        part -= tl.sum(tl.reshape(offset, (GROUPS, BLOCK_KW // GROUPS)), axis=1)[:, None]
        at = (k0 // group_size + tl.arange(0, GROUPS))[:, None] * N + offs_n[None, :]
        if HAS_ZERO:
            x_sums = tl.sum(tl.reshape(odd + even, (GROUPS, BLOCK_KW // GROUPS)), axis=1)  # [G]
            part -= tl.load(z_ptr + at, mask=n_ok[None, :], other=0.0) * x_sums[:, None]
        return tl.sum(part * tl.load(s_ptr + at, mask=n_ok[None, :], other=0.0), axis=0)

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _w4a16_gemv_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, s_ptr, z_ptr, sums_ptr, counts_ptr, out_ptr, N, K, group_size,
        HAS_ZERO: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
        GROUPS: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        rows = tl.arange(0, BLOCK_KW)
        # This program's run of whole tiles: the runs differ by at most one tile.
        k_tiles = K // (BLOCK_KW * 8)
        k_start = (pid_k * k_tiles // SPLIT_K) * (BLOCK_KW * 8)
        k_end = ((pid_k + 1) * k_tiles // SPLIT_K) * (BLOCK_KW * 8)
        # The weights are no kernel's output: the first tile is read before the wait for the
        # kernel before (PDL), so its latency overlaps that kernel's end.
        words = tl.load(w_ptr + (k_start // 8 + rows)[:, None].to(tl.int64) * N + offs_n[None, :],
                        mask=n_ok[None, :], other=0)  # fmt: skip
        pdl_wait(PDL)
        acc = _int4_tile_dot(words, x_ptr, k_start, s_ptr, z_ptr, offs_n, n_ok, N, group_size, HAS_ZERO, BLOCK_N,
                             BLOCK_KW, GROUPS)  # fmt: skip
        for k0 in range(k_start + BLOCK_KW * 8, k_end, BLOCK_KW * 8):
            words = tl.load(w_ptr + (k0 // 8 + rows)[:, None].to(tl.int64) * N + offs_n[None, :], mask=n_ok[None, :],
                            other=0)  # fmt: skip
            acc += _int4_tile_dot(words, x_ptr, k0, s_ptr, z_ptr, offs_n, n_ok, N, group_size, HAS_ZERO, BLOCK_N,
                                  BLOCK_KW, GROUPS)  # fmt: skip
        if SPLIT_K == 1:
            tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
        else:
            # Each split's partial sums to a row of their own; the tile's last program to
            # finish adds them up in split order and writes the output: reproducible, one
            # launch, no memset or cast around it. (Atomic adds into one row, read by the last
            # program with no barrier after the other threads' adds, raced: errors of 1e-2.)
            tl.store(sums_ptr + pid_k * N + offs_n, acc, mask=n_ok)
            tl.debug_barrier()  # every thread's partials are written before the count (acq_rel) goes up
            if tl.atomic_add(counts_ptr + pid_n, 1) == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for other in tl.static_range(SPLIT_K):  # .cg: the other programs' rows, from L2
                    total += tl.load(sums_ptr + other * N + offs_n, mask=n_ok, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
                tl.store(counts_ptr + pid_n, 0)


def _gemv_split(n: int, k: int, group_size: int, num_sms: int) -> tuple[int, int, int]:
    """(SPLIT_K, BLOCK_KW, GROUPS) for a batch-1 product over 512-output column tiles. Tiles
    of BLOCK_KW words, 8 where the layer allows (a sweep on the H100 over the 8B projections,
    bench/results/int4_gemv_sweep_h100_2026-11-27.txt); a tile lies inside one group, or
    holds GROUPS whole ones (groups of 32: two per tile of 64 inputs).

    The grid is one wave: at most GEMV_PROGRAMS_PER_SM programs an SM (its registers capped
    so that they fit), each with a run of whole tiles of K; SPLIT_K is the fewest runs that
    give the shortest longest run, so no program waits on a second wave and the last
    program sums as few partial rows as it can. The grids before (four programs an SM asked
    for where 136 registers let three in: 1.3-2.3 waves) took 8 % longer over the 8B's four
    projections (cold weights: 84.2 against 77.3 us a layer;
    bench/results/int4_gemv_waves_h100_2026-11-28.txt): a later wave starts cold and its last programs run alone, and
    12-16 warps an SM leave little else to hide the loads' latency behind."""
    block_kw = next(kw for kw in (8, 4, 2, 1)
                    if k % (kw * 8) == 0 and (group_size % (kw * 8) == 0 or (kw * 8) % group_size == 0))  # fmt: skip
    tiles = -(-n // GEMV_BLOCK_N)
    k_tiles = k // (block_kw * 8)
    most = max(1, min(k_tiles, GEMV_PROGRAMS_PER_SM * num_sms // tiles))
    longest = -(-k_tiles // most)
    return -(-k_tiles // longest), block_kw, max(1, block_kw * 8 // group_size)


def w4a16_gemv(x: torch.Tensor, w: Int4Linear) -> torch.Tensor:
    """x [1, K] @ dequantized W [K, N] -> [1, N] in x's dtype, one launch."""
    k, n = x.shape[1], w.qweight.shape[1]
    split, block_kw, groups = _gemv_split(n, k, w.group_size, num_sms(x.device))
    if split > w.split_sums.shape[0]:
        raise ValueError(f"the W4A16 GEMV splits K {split} ways; its layer holds {w.split_sums.shape[0]} rows")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    grid = (-(-n // GEMV_BLOCK_N), split)
    _w4a16_gemv_kernel[grid](
        x.contiguous(), w.qweight, w.scale, w.scale if w.zero is None else w.zero, w.split_sums, w.split_counts, out,
        n, k, w.group_size, HAS_ZERO=w.zero is not None, SPLIT_K=split, BLOCK_N=GEMV_BLOCK_N, BLOCK_KW=block_kw,
        GROUPS=groups, num_warps=4, num_stages=1, maxnreg=GEMV_MAX_REGISTERS, **pdl.options(x.device, 1),
    )  # fmt: skip
    return out


def _w4a16_plan(m: int, n: int, k: int, group_size: int, num_sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps) for an [m, k] x [k, n] product."""
    block_k = next(b for b in (64, 32, 16) if group_size % b == 0)  # one group per tile (see int4_linear)
    if m <= 16:
        block_m, block_n, warps = 16, 64, 4
    elif m <= 64:
        block_m, block_n, warps = 64, 128, 4
    else:
        block_m, block_n, warps = 128, 128, 8
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    # Memory-bound small batches: split K until every SM streams weights (2 programs each).
    while tiles * split < 2 * num_sms and k % (split * 2 * block_k) == 0 and k // (split * 2) >= 4 * block_k:
        split *= 2
    return block_m, block_n, block_k, split, warps


def w4a16_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """x [M, K] (bf16/fp16) @ dequantized W [K, N] -> [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    block_m, block_n, block_k, split, warps = _w4a16_plan(m, n, k, group_size, num_sms(x.device))
    out = torch.empty((split, m, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    _w4a16_kernel[grid](
        x, qweight, scale, scale if zero is None else zero, out, m, n, k, x.stride(0), n, group_size,
        HAS_ZERO=zero is not None, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=3,
    )  # fmt: skip
    return out[0] if split == 1 else out.sum(0).to(x.dtype)


def dequantize_int4(w: Int4Linear) -> torch.Tensor:
    """The float32 weight [out, in] an Int4Linear stands for (the GPU tests' reference)."""
    q = _unpack_along_in(w.qweight.t().contiguous()).float()  # [out, in]
    out, n_in = q.shape
    groups = q.view(out, n_in // w.group_size, w.group_size)
    if w.zero is not None:
        groups = groups - w.zero.t()[:, :, None]
    return (groups * w.scale.t()[:, :, None]).view(out, n_in)
