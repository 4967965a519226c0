"""A Triton FP8 GEMM, and the per-shape choice between it and cuBLAS made at start-up.

out [M, N] = (xq [M, K] @ wq [N, K]^T) * x_scale [M] * w_scale [N]: e4m3 in, float32
accumulation on the FP8 tensor cores (tl.dot), bf16 out; what `torch._scaled_mm` computes
with row-wise scales. Why by hand: at some row counts cuBLASLt's heuristics pick FP8
kernels well below what the shape allows, and no maintained library that installs on the
GPU host offers another FP8 GEMM. Timed in CUDA graphs over cold weights on an H100
(bench/results/fp8_gemm_graph_sweep_h100_2026-11-27.txt), the 8B's layer at 448 rows took
250 us with cuBLAS and 200 with this kernel (gate_up 129.5 -> 110.8, qkv 36.7 -> 22.6), at
320 rows 198 against 166; at 256, 384 and 512 rows cuBLAS is as fast or faster. Hence a
choice, made per (rows, out, in) on the device at hand, not a replacement.

Each program computes one [BLOCK_M, BLOCK_N] tile over all of K, or over one of SPLIT_K
equal parts of it; the programs that share a weight tile run next to each other (M varies
fastest), so the weights are read from HBM about once and the other row tiles find them in
L2. Split tiles are for few rows: a narrow output (the 8B's o and down: 4096 columns, 64
programs of 64) would leave most SMs idle while each program walks all of K. Their parts
are written as float32 planes and summed in a fixed order (torch), so a product is
reproducible. On an H100 the 8B's down at 2-64 rows takes 27-32 us split four ways,
against 38-46 with cuBLAS and about 36 unsplit, and with the Triton tiles below 16 rows
too a decode step of 2-8 sequences went from 5.1 to 4.3 ms
(bench/results/fp8_gemm_split_h100_2026-11-27.txt).

`tune` times cuBLAS and each of `TILES` over the model's own weights, every layer's in
turn so that the weights come cold from HBM as in a step, replayed in a CUDA graph as the
decode steps run them, and keeps the Triton GEMM for that row count only where it beats
cuBLAS by `MARGIN`: a near tie keeps cuBLAS, so the choice (and with it the rounding of the
products) does not flip from one start to the next.

The row counts timed are the decode graphs' and the full prefill chunk's (max_num_tokens,
which most prefill steps fill); the graphs' choices hold inside the graphs only, so an eager
step at a graph's row count runs cuBLAS as before (quant_linear.Fp8Linear). Other row counts
run cuBLAS.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker.backends.cuda_graphs import replay_microseconds

try:
    import triton  # type: ignore[import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # the CPU host
    triton = None

log = logging.getLogger(__name__)

BLOCK_K = 128
# One row runs the GEMV (gemv.py); rows short of a tile are masked.
MIN_ROWS = 2
# Split tiles are timed up to this many rows: past it there are tiles enough without, and
# the float32 planes would cost more than they save.
MAX_SPLIT_ROWS = 128
# The Triton GEMM replaces cuBLAS only when it takes at most this fraction of cuBLAS's time.
MARGIN = 0.9


@dataclass(frozen=True, slots=True)
class Tile:
    """A launch of the Triton GEMM: its tile and software pipeline."""

    block_m: int
    block_n: int
    stages: int
    warps: int
    split_k: int = 1  # programs that share one output tile, each over K / split_k


# Each was the fastest somewhere in a graph-timed sweep of the 8B's and the 70B's (per
# tensor-parallel rank of two) projections at 16-512 rows on an H100
# (bench/results/fp8_gemm_graph_sweep_h100_2026-11-27.txt): small tiles for few rows and
# narrow outputs, wide ones for gate_up.
TILES = (Tile(64, 64, 4, 4), Tile(64, 128, 5, 4), Tile(64, 128, 3, 4), Tile(128, 128, 3, 8), Tile(128, 128, 4, 8),
         Tile(128, 256, 3, 8), Tile(64, 64, 4, 4, 2), Tile(64, 64, 4, 4, 4), Tile(64, 64, 4, 4, 8))  # fmt: skip


def takes(tile: Tile, rows: int, k: int) -> bool:
    """Whether `tile` runs a product of `rows` rows over k inputs: every split whole BLOCK_K
    tiles, and split tiles only for few rows."""
    return k % (BLOCK_K * tile.split_k) == 0 and (tile.split_k == 1 or rows <= MAX_SPLIT_ROWS)


def supports(rows: int, k: int) -> bool:
    """Whether the kernel takes this product: whole BLOCK_K tiles of the input (no mask
    along K), and at least MIN_ROWS rows."""
    return triton is not None and k % BLOCK_K == 0 and rows >= MIN_ROWS


def fp8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype, tile: Tile) -> torch.Tensor:  # fmt: skip
    """xq e4m3 [M, K] (rows contiguous), x_scale float32 [M, 1]; wq e4m3 [N, K], w_scale
    float32 [1, N]; K a multiple of BLOCK_K (`supports`)."""
    m, k = xq.shape
    n = wq.shape[0]
    split = tile.split_k
    if k % (BLOCK_K * split):
        raise ValueError(f"the FP8 GEMM splits {k} inputs into {split} parts of whole {BLOCK_K}-input tiles")
    out = torch.empty((split, m, n), dtype=out_dtype if split == 1 else torch.float32, device=xq.device)
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n), split)
    _fp8_gemm_kernel[grid](
        xq, wq, x_scale, w_scale, out, m, n, k, xq.stride(0), wq.stride(0), n,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=BLOCK_K, SPLIT_K=split, num_warps=tile.warps,
        num_stages=tile.stages,
    )  # fmt: skip
    return out[0] if split == 1 else out.sum(0).to(out_dtype)


def scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The same product through cuBLASLt (row-wise scales)."""
    return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)


@dataclass(frozen=True, slots=True)
class Timing:
    """One shape's measurement at one row count: microseconds a product, cuBLAS's and the
    fastest tile's, and the tile kept (None: cuBLAS)."""

    rows: int
    out_features: int
    in_features: int
    cublas_us: float
    triton_us: float  # inf: no tile ran on this device
    fastest: Tile | None
    kept: Tile | None


def describe(timings: Sequence[Timing]) -> str:
    """One row count's timings on a line: each shape's cuBLAS / fastest Triton microseconds,
    and the tile kept."""
    def one(t: Timing) -> str:
        split = f"/{t.kept.split_k}" if t.kept and t.kept.split_k > 1 else ""
        kept = f" -> Triton {t.kept.block_m}x{t.kept.block_n}{split}" if t.kept else ""
        return f"{t.out_features}x{t.in_features} {t.cublas_us:.1f} / {t.triton_us:.1f}{kept}"

    return "; ".join(one(t) for t in timings)


def choose(cublas_us: float, triton_us: dict[Tile, float]) -> Tile | None:
    """The fastest tile, where it takes at most MARGIN of cuBLAS's time; else None (cuBLAS)."""
    fastest = min(triton_us, key=lambda t: triton_us[t], default=None)
    return fastest if fastest is not None and triton_us[fastest] <= MARGIN * cublas_us else None


@torch.inference_mode()
def tune(rows: int, weights: Sequence[tuple[torch.Tensor, torch.Tensor]], out_dtype: torch.dtype) -> list[Timing]:
    """Time cuBLAS and every tile at `rows` rows over `weights` ((e4m3 [N, K], float32
    scales [1, N]) of every layer), grouped by shape; one Timing per shape the kernel takes."""
    by_shape: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for w, s in weights:
        by_shape.setdefault((w.shape[0], w.shape[1]), []).append((w, s))
    return [_time_shape(rows, group, out_dtype) for (_, k), group in by_shape.items() if supports(rows, k)]


def _time_shape(rows: int, group: list[tuple[torch.Tensor, torch.Tensor]], out_dtype: torch.dtype) -> Timing:
    n, k = group[0][0].shape
    device = group[0][0].device
    xq = torch.randn(rows, k, device=device).to(torch.float8_e4m3fn)
    x_scale = torch.rand(rows, 1, device=device) + 0.5

    def per_product(product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        def one_pass() -> None:
            for w, s in group:
                product(w, s)  # each output freed at once: one product's memory in the graph's pool

        return _graph_microseconds(one_pass) / len(group)

    def on_tile(tile: Tile) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda w, s: fp8_matmul(xq, x_scale, w, s, out_dtype, tile)

    cublas = per_product(lambda w, s: scaled_mm(xq, x_scale, w, s, out_dtype))
    tiles = {}
    for tile in (t for t in TILES if takes(t, rows, k)):
        try:
            tiles[tile] = per_product(on_tile(tile))
        except Exception as e:
            # Triton's compile or launch errors: this device cannot run the tile (a GPU with
            # less shared memory than its pipeline stages take, say), so it is left out.
            log.info("FP8 GEMM tile %s left out at %d rows: %s: %s", tile, rows, type(e).__name__, e)
    if not tiles:
        return Timing(rows, n, k, cublas, math.inf, None, None)
    fastest = min(tiles, key=lambda t: tiles[t])
    return Timing(rows, n, k, cublas, tiles[fastest], fastest, choose(cublas, tiles))


def _graph_microseconds(one_pass: Callable[[], None]) -> float:
    """`one_pass` captured in a CUDA graph and timed replaying, as the decode graphs run it:
    launched from Python, a Triton call costs more host time than a small product takes on
    the GPU, and the timing would measure the host."""
    one_pass()  # Triton compiles, cuBLAS picks its kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one_pass()
    return replay_microseconds(graph)


if triton is not None:

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _fp8_gemm_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, sx_ptr, sw_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        part = tl.program_id(1)  # this program's share of K, and its output plane
        tiles_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % tiles_m
        pid_n = pid // tiles_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_tiles = K // BLOCK_K // SPLIT_K
        offs_k = part * k_tiles * BLOCK_K + tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x + offs_k[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for _ in range(k_tiles):
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)  # both K-major, as the FP8 tensor cores take them
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        sx = tl.load(sx_ptr + offs_m, mask=m_ok, other=0.0)
        sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=0.0)
        out = acc * sx[:, None] * sw[None, :]
        plane = out_ptr + part.to(tl.int64) * M * stride_out
        o_ptrs = plane + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
