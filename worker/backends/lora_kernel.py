"""Many LoRA adapters in one batch: `y[t] += (x[t] @ A[s]^T) @ B[s]^T` with `s = slots[t]`,
for every token whose slot is not -1 (Punica's SGMV / S-LoRA's MBGMM, as Triton kernels).

Layout (the device slots of the adapter cache): `a` [S, R, in], `b` [S, out, R], R the
padded rank (a fused projection stacks its parts' ranks, `b` block-diagonal, zeros pad);
the scaling alpha / r is already folded into `b`.

Three kernels, no host synchronisation and no data-dependent shape, so that a step runs
inside a CUDA graph with fixed tensors:
- plan (batches of more than SCAN_MAX_TOKENS tokens): one program counting-sorts the
  token indices by slot (stable; slot -1 dropped) and cuts each slot's run into tiles of
  BLOCK_M tokens; the tile table has a fixed length, cdiv(T, BLOCK_M) + min(S, T), and
  unused entries say slot -1. So an adapter's A and B are read once per tile, not once per
  token, and a prefill chunk (one request, one slot) is a run of full tiles.
- shrink: x rows of a tile (gathered) @ A[s]^T into a float32 [T, R] intermediate; a small
  batch splits the input dimension over programs (float32 atomic adds) so that every SM
  streams some of x and A.
- expand: intermediate rows (cast to the weights' dtype, as Punica does) @ B[s]^T, added
  to y in float32 and stored back.
A batch of at most SCAN_MAX_TOKENS tokens (decode at small batch) skips the plan: program
g of shrink and expand serves slot g and scans the few tokens for its own, which saves a
launch where launches are what a step costs.

The plan depends on the slots alone, so a step may make it once (`plan_lora`) and pass it
to each of its add_lora calls (4 per layer) instead of each call making its own.

Why hand-written: no maintained library does batched multi-adapter LoRA for torch and
installs from the registry onto the GPU host (which has torch and Triton, no compiler
toolchain and no pip). Punica's BGMV/SGMV kernels (punica-ai/punica) are CUDA/CUTLASS built
from source with nvcc against one torch, and the registry's `punica` is an unrelated
package (LoRAX ships Punica's kernels compiled inside its own server); vLLM's Triton
`lora_shrink` / `lora_expand` (after Punica) and SGLang's ship inside those whole serving
engines, which pin their own torch (vLLM groups a step's tokens once, with torch.sort /
unique into fixed buffers, while preparing the step's inputs outside its graphs);
S-LoRA's kernels live in its research repository.

`add_lora_reference` is the plain-torch version: the CPU path and the tests' oracle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from worker.backends.sm_count import num_sms

try:
    import triton  # type: ignore[import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # the CPU host: the reference needs no Triton
    triton = None

# At most this many tokens: no plan kernel, each slot's programs scan all the tokens.
SCAN_MAX_TOKENS = 64


@dataclass(frozen=True, slots=True)
class LoraPlan:
    """A step's tokens grouped by slot, for every add_lora of the step to share."""

    order: torch.Tensor  # int32 [T]: token indices, slot by slot (stable), slot -1 left out
    tiles: torch.Tensor  # int32 [3, max_tiles]: slot (-1: unused) | first | end position in `order`
    block_m: int  # tokens per tile


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
             plan: LoraPlan | None = None) -> None:  # fmt: skip
    """y [T, out] += LoRA of x [T, in] under each token's slot (int64 [T], -1: none), in place.
    `plan`: `plan_lora(slots, S)` made once for the step (optional; ignored on the CPU)."""
    check_shapes(y, x, a, b, slots)
    if triton is not None and x.is_cuda:
        add_lora_triton(y, x, a, b, slots, plan=plan)
    else:
        add_lora_reference(y, x, a, b, slots)


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       slots: torch.Tensor) -> None:  # fmt: skip
    """The same in plain torch, one product pair per slot present, in float32 (float64 for
    float64 inputs). Reads the slots on the host: not for CUDA graphs."""
    acc = torch.promote_types(x.dtype, torch.float32)
    for s in torch.unique(slots[slots >= 0]).tolist():
        rows = torch.nonzero(slots == s).squeeze(1)
        delta = (x[rows].to(acc) @ a[s].to(acc).T) @ b[s].to(acc).T
        y[rows] = (y[rows].to(acc) + delta).to(y.dtype)


def check_shapes(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """Shapes and dtypes only (never the slots' values: that would wait for the device)."""
    t, n_in = x.shape
    s, r, a_in = a.shape
    if a_in != n_in or b.shape != (s, y.shape[1], r) or y.shape[0] != t or slots.shape != (t,):
        raise ValueError(f"add_lora: y {tuple(y.shape)}, x {tuple(x.shape)}, a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, slots {tuple(slots.shape)} do not fit y[T, out], x[T, in], "
                         "a[S, R, in], b[S, out, R], slots[T]")  # fmt: skip
    if not x.dtype == y.dtype == a.dtype == b.dtype:
        raise ValueError(f"add_lora: dtypes differ: y {y.dtype}, x {x.dtype}, a {a.dtype}, b {b.dtype}")


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    grouped: bool  # plan first (tiles of one slot's tokens); else one program per slot scans all tokens
    block_m: int  # tokens per tile
    block_k: int  # shrink: input columns per loop step
    block_r: int  # shrink: rank columns per program
    split_k: int  # shrink: programs sharing one tile's input dimension (then atomic adds)
    block_n: int  # expand: output columns per program
    num_warps: int


def tile_tokens(num_tokens: int) -> int:
    """BLOCK_M: 16 rows fill a tensor-core tile for decode batches; prefill-sized batches take
    64 so that each adapter's A and B are read by fewer tiles."""
    return 16 if num_tokens <= 1024 else 64


@functools.lru_cache(maxsize=1024)
def launch_config(num_tokens: int, n_in: int, rank: int, num_slots: int, num_sms: int) -> LaunchConfig:
    """Tile sizes from the shapes alone (the same for every replay of a graph)."""
    grouped = num_tokens > SCAN_MAX_TOKENS
    block_m = tile_tokens(num_tokens)
    block_k = 128 if block_m == 16 else 64
    block_r = min(64, max(16, 1 << (rank - 1).bit_length()))  # a power of two, 16 to 64
    # Programs with rows to do: one per tile, or one per slot present.
    busy = -(-num_tokens // block_m) if grouped else min(num_slots, num_tokens)
    busy *= -(-rank // block_r)
    split = 1
    # Memory-bound small batches: split the input until every SM streams (2 programs each),
    # each program keeping at least two steps of block_k.
    while busy * split < 2 * num_sms and n_in // (2 * split) >= 2 * block_k:
        split *= 2
    block_n = 64 if num_tokens <= SCAN_MAX_TOKENS else 128
    return LaunchConfig(grouped, block_m, block_k, block_r, split, block_n, 8 if block_m >= 64 else 4)


def plan_lora(slots: torch.Tensor, num_slots: int) -> LoraPlan | None:
    """The plan add_lora would make for these slots (None: a batch small enough to scan),
    made on the device without a host read, so it may be captured in a graph with the calls
    that use it."""
    t = slots.shape[0]
    if t <= SCAN_MAX_TOKENS or num_slots == 0:
        return None
    return _make_plan(slots, num_slots, tile_tokens(t))


def _make_plan(slots: torch.Tensor, num_slots: int, block_m: int) -> LoraPlan:
    if triton is None:
        raise RuntimeError("the LoRA plan needs Triton (a CUDA host)")
    t = slots.shape[0]
    max_tiles = -(-t // block_m) + min(num_slots, t)  # sum over slots of cdiv(count, block_m), at most
    order = torch.empty(t, dtype=torch.int32, device=slots.device)
    tiles = torch.empty((3, max_tiles), dtype=torch.int32, device=slots.device)
    slots_pad = max(16, triton.next_power_of_2(num_slots))
    _plan_kernel[(1,)](
        slots.contiguous(), order, tiles, t, num_slots, max_tiles,
        BLOCK_M=block_m, SLOTS_PAD=slots_pad, BLOCK_T=max(16, min(512, 8192 // slots_pad)), num_warps=8,
    )  # fmt: skip
    return LoraPlan(order, tiles, block_m)


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                    config: LaunchConfig | None = None, plan: LoraPlan | None = None) -> None:  # fmt: skip
    """The Triton path (CUDA; or the CPU under TRITON_INTERPRET=1). Inner dimensions must be
    contiguous; rows may be strided. `config` overrides the tile sizes (tests); a `plan`
    given is used wherever the batch is planned."""
    if triton is None:
        raise RuntimeError("add_lora_triton needs Triton (a CUDA host)")
    t, n_in = x.shape
    num_slots, rank, _ = a.shape
    n_out = y.shape[1]
    if t == 0 or num_slots == 0:
        return
    if x.stride(1) != 1 or y.stride(1) != 1 or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError("add_lora: x, y, a and b need a contiguous last dimension")
    slots = slots.contiguous()  # the kernels index it densely; a no-op for the engine's own buffer
    cfg = config or launch_config(t, n_in, rank, num_slots, num_sms(x.device))
    # float32 inputs (parity runs) get IEEE dots, not TF32.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    block_m = cfg.block_m
    if cfg.grouped:
        if plan is None:
            plan = _make_plan(slots, num_slots, cfg.block_m)
        order, tiles, block_m = plan.order, plan.tiles, plan.block_m
        max_tiles = groups = tiles.shape[1]
    else:
        order = tiles = slots  # unused
        max_tiles, groups = 0, num_slots
    inter = (torch.zeros if cfg.split_k > 1 else torch.empty)((t, rank), dtype=torch.float32, device=x.device)
    k_span = triton.cdiv(triton.cdiv(n_in, cfg.split_k), cfg.block_k) * cfg.block_k
    _shrink_kernel[(groups, triton.cdiv(rank, cfg.block_r), cfg.split_k)](
        x, a, inter, slots, order, tiles, t, n_in, rank, max_tiles, k_span,
        x.stride(0), a.stride(0), a.stride(1), inter.stride(0),
        GROUPED=cfg.grouped, ATOMIC=cfg.split_k > 1, BLOCK_M=block_m, BLOCK_R=cfg.block_r,
        BLOCK_K=cfg.block_k, PRECISION=precision, num_warps=cfg.num_warps,
    )  # fmt: skip
    _expand_kernel[(groups, triton.cdiv(n_out, cfg.block_n))](
        y, b, inter, slots, order, tiles, t, n_out, rank, max_tiles,
        y.stride(0), b.stride(0), b.stride(1), inter.stride(0),
        GROUPED=cfg.grouped, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        RANK_PAD=max(16, triton.next_power_of_2(rank)), PRECISION=precision, num_warps=cfg.num_warps,
    )  # fmt: skip


if triton is not None:
    # The token count changes from step to step (and the tile count and split with it):
    # not specialized on, so that a new count does not compile new kernels mid-run.

    @triton.jit(do_not_specialize=["T", "max_tiles"])  # type: ignore[misc,unused-ignore]
    def _plan_kernel(  # type: ignore[no-untyped-def]
        slots_ptr, order_ptr, tiles_ptr, T, S, max_tiles,
        BLOCK_M: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    ):  # fmt: skip
        # One program: T is at most a step's token budget, and this is a few passes over it.
        cols = tl.arange(0, SLOTS_PAD)
        counts = tl.zeros([SLOTS_PAD], dtype=tl.int32)
        for t0 in range(0, T, BLOCK_T):
            rows = t0 + tl.arange(0, BLOCK_T)
            s = tl.load(slots_ptr + rows, mask=rows < T, other=-1)
            hit = ((s[:, None] == cols[None, :]) & (cols[None, :] < S)).to(tl.int32)  # [BLOCK_T, SLOTS_PAD]
            counts += tl.sum(hit, axis=0)
        starts = tl.cumsum(counts, axis=0) - counts
        # Stable counting sort: a token goes after its slot's earlier tokens.
        nxt = starts
        for t0 in range(0, T, BLOCK_T):
            rows = t0 + tl.arange(0, BLOCK_T)
            s = tl.load(slots_ptr + rows, mask=rows < T, other=-1)
            hit = ((s[:, None] == cols[None, :]) & (cols[None, :] < S)).to(tl.int32)
            before = tl.cumsum(hit, axis=0) - hit  # same-slot tokens earlier in this block
            pos = tl.sum(hit * (nxt[None, :] + before), axis=1)
            tl.store(order_ptr + pos, rows, mask=tl.sum(hit, axis=1) > 0)
            nxt += tl.sum(hit, axis=0)
        # Tiles: slot s owns tiles [tile_end[s] - n_tiles[s], tile_end[s]).
        n_tiles = (counts + BLOCK_M - 1) // BLOCK_M
        tile_end = tl.cumsum(n_tiles, axis=0)
        total = tl.sum(n_tiles, axis=0)
        for g0 in range(0, max_tiles, BLOCK_T):
            g = g0 + tl.arange(0, BLOCK_T)
            # The owner: the first slot whose tiles end after g (empty slots end where the last did).
            owner = tl.sum((tile_end[None, :] <= g[:, None]).to(tl.int32), axis=1)
            sel = cols[None, :] == owner[:, None]
            first_tile = tl.sum(tl.where(sel, (tile_end - n_tiles)[None, :], 0), axis=1)
            start = tl.sum(tl.where(sel, starts[None, :], 0), axis=1)
            count = tl.sum(tl.where(sel, counts[None, :], 0), axis=1)
            row0 = start + (g - first_tile) * BLOCK_M
            ok = g < max_tiles
            tl.store(tiles_ptr + g, tl.where(g < total, owner, -1), mask=ok)
            tl.store(tiles_ptr + max_tiles + g, row0, mask=ok)
            tl.store(tiles_ptr + 2 * max_tiles + g, tl.minimum(row0 + BLOCK_M, start + count), mask=ok)

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _shrink_rows(  # type: ignore[no-untyped-def]
        x_ptr, a_ptr, inter_ptr, rows, row_ok, slot, r0, k_begin, k_end, K, R, stride_x, stride_as, stride_ar,
        stride_inter, ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        a_cols = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            xt = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_cols + offs_k[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # A^T tile
            acc += tl.dot(xt, at, input_precision=PRECISION)
        out = inter_ptr + rows.to(tl.int64)[:, None] * stride_inter + offs_r[None, :]
        if ATOMIC:
            # Only the sum matters, not the order of the adds: no memory ordering needed.
            tl.atomic_add(out, acc, mask=row_ok[:, None] & r_ok[None, :], sem="relaxed")
        else:
            tl.store(out, acc, mask=row_ok[:, None] & r_ok[None, :])

    @triton.jit(do_not_specialize=["T", "max_tiles", "k_span"])  # type: ignore[misc,unused-ignore]
    def _shrink_kernel(  # type: ignore[no-untyped-def]
        x_ptr, a_ptr, inter_ptr, slots_ptr, order_ptr, tiles_ptr, T, K, R, max_tiles, k_span,
        stride_x, stride_as, stride_ar, stride_inter,
        GROUPED: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        g = tl.program_id(0)
        r0 = tl.program_id(1) * BLOCK_R
        k_begin = tl.program_id(2) * k_span
        k_end = tl.minimum(k_begin + k_span, K)
        offs_m = tl.arange(0, BLOCK_M)
        if GROUPED:  # program g: tile g of the plan
            slot = tl.load(tiles_ptr + g)
            if slot < 0:
                return
            row0 = tl.load(tiles_ptr + max_tiles + g)
            row_ok = offs_m < tl.load(tiles_ptr + 2 * max_tiles + g) - row0
            rows = tl.load(order_ptr + row0 + offs_m, mask=row_ok, other=0)
            _shrink_rows(x_ptr, a_ptr, inter_ptr, rows, row_ok, slot, r0, k_begin, k_end, K, R, stride_x,
                         stride_as, stride_ar, stride_inter, ATOMIC, BLOCK_M, BLOCK_R, BLOCK_K, PRECISION)  # fmt: skip
        else:  # program g: slot g, over the blocks of tokens holding any of its own
            for t0 in range(0, T, BLOCK_M):
                rows = t0 + offs_m
                row_ok = tl.load(slots_ptr + rows, mask=rows < T, other=-1) == g
                if tl.max(row_ok.to(tl.int32), axis=0) > 0:
                    _shrink_rows(x_ptr, a_ptr, inter_ptr, rows, row_ok, g, r0, k_begin, k_end, K, R, stride_x,
                                 stride_as, stride_ar, stride_inter, ATOMIC, BLOCK_M, BLOCK_R, BLOCK_K,
                                 PRECISION)  # fmt: skip

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _expand_rows(  # type: ignore[no-untyped-def]
        y_ptr, b_ptr, inter_ptr, rows, row_ok, slot, offs_n, n_ok, R, stride_y, stride_bs, stride_bn, stride_inter,
        RANK_PAD: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        offs_r = tl.arange(0, RANK_PAD)
        r_ok = offs_r < R
        rows64 = rows.to(tl.int64)
        h = tl.load(inter_ptr + rows64[:, None] * stride_inter + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :],
                    other=0.0)  # fmt: skip
        bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :].to(tl.int64) * stride_bn
                     + offs_r[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # B^T tile  # fmt: skip
        delta = tl.dot(h.to(bt.dtype), bt, input_precision=PRECISION)
        mask = row_ok[:, None] & n_ok[None, :]
        out = y_ptr + rows64[:, None] * stride_y + offs_n[None, :]
        y = tl.load(out, mask=mask, other=0.0)
        tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["T", "max_tiles"])  # type: ignore[misc,unused-ignore]
    def _expand_kernel(  # type: ignore[no-untyped-def]
        y_ptr, b_ptr, inter_ptr, slots_ptr, order_ptr, tiles_ptr, T, N, R, max_tiles,
        stride_y, stride_bs, stride_bn, stride_inter,
        GROUPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RANK_PAD: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        g = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_m = tl.arange(0, BLOCK_M)
        if GROUPED:  # program g: tile g of the plan
            slot = tl.load(tiles_ptr + g)
            if slot < 0:
                return
            row0 = tl.load(tiles_ptr + max_tiles + g)
            row_ok = offs_m < tl.load(tiles_ptr + 2 * max_tiles + g) - row0
            rows = tl.load(order_ptr + row0 + offs_m, mask=row_ok, other=0)
            _expand_rows(y_ptr, b_ptr, inter_ptr, rows, row_ok, slot, offs_n, n_ok, R, stride_y, stride_bs,
                         stride_bn, stride_inter, RANK_PAD, PRECISION)  # fmt: skip
        else:  # program g: slot g (its B tile is read only where it has tokens)
            for t0 in range(0, T, BLOCK_M):
                rows = t0 + offs_m
                row_ok = tl.load(slots_ptr + rows, mask=rows < T, other=-1) == g
                if tl.max(row_ok.to(tl.int32), axis=0) > 0:
                    _expand_rows(y_ptr, b_ptr, inter_ptr, rows, row_ok, g, offs_n, n_ok, R, stride_y, stride_bs,
                                 stride_bn, stride_inter, RANK_PAD, PRECISION)  # fmt: skip
