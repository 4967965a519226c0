"""Attention over the paged KV cache for packed variable-length queries.

One Triton kernel serves prefill chunks, generation tokens and any mix of them:
each program takes a tile of BLOCK_Q query tokens of one sequence and the
GROUP query heads that share one KV head (GQA), so the tile is a
[BLOCK_Q * GROUP, head_dim] matrix and every K/V block read from the cache feeds
all of those heads at once. K and V are read block by block through the block
table; queries see keys at positions <= their own (and within the sliding window
when the model has one), with an online softmax in float32.

The new tokens' K and V must already be in the cache (the backend writes them
first), so a chunk attends to its cached prefix and to itself the same way.

`paged_attention_torch` is the plain-torch reference: the CPU path, and the
oracle the kernel is tested against.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from worker.backends import pdl

try:
    import triton  # type: ignore[import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # the CPU host: the torch path needs no Triton
    triton = None

# Query tokens per program for chunks longer than one token.
PREFILL_BLOCK_Q = 16


def tile_map(query_start: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, first query offset) of every BLOCK_Q tile, for a packed batch."""
    q_lens = np.diff(query_start)
    n_tiles = -(-q_lens // block_q)
    tile_seq = np.repeat(np.arange(len(q_lens), dtype=np.int32), n_tiles)
    first_tile = np.concatenate(([0], np.cumsum(n_tiles)[:-1])).astype(np.int64)
    tile_q0 = (np.arange(int(n_tiles.sum())) - first_tile[tile_seq]) * block_q
    return tile_seq, tile_q0.astype(np.int32)


# Keys per loop iteration: several cache blocks at once, so each program keeps
# enough bytes in flight (one 16-token block per step starves the memory system).
KEYS_PER_ITER = 64


def keys_per_iter(block_d: int, block_size: int, fp8_decode: bool) -> int:
    """Keys per loop iteration for a head of `block_d` (a power of two) dimensions.

    A decode step over an e4m3 cache runs with capped registers and a third stage (below);
    at head_dim 256 a 64-key tile is twice the bytes those were tuned for, and 32 keys
    are faster where most of a step is short contexts: on an H200, Gemma 3 12B's heads at
    512 sequences x 192 keys 160 against 195 us a layer, 256 x 1024 403 against 419, equal
    at 128 x 1536, slower only at 64 x 4096 (442 against 397); FP8 Gemma 3 12B 128/128
    13,716 -> 14,614 tok/s, 1000/1000 6,585 -> 6,915. A bf16 cache keeps 64 keys at every
    head width: 32 were no faster there and slower at long contexts
    (bench/results/attention_tiles_h200_2026-11-28.txt, `python3 -m bench.attention_bench`).
    Never fewer than one cache block."""
    keys = KEYS_PER_ITER * 128 // max(block_d, 128) if fp8_decode else KEYS_PER_ITER
    return max(block_size, keys)
# A decode step over an e4m3 cache: a third stage, and at most 128 registers a thread, so
# four programs fit an SM where three did (168 registers; ncu: 19 % occupancy, half the
# cycles with no warp ready). On an H100 a layer at 380 sequences x context 1536 took 471 us
# against 519 us with 128 keys, three stages and no cap, and 194 against 253 us at 1024 x 192;
# other tiles, stages, caps and warp counts were no faster
# (bench/results/attention_fp8_occupancy_h100_2026-11-27.txt).
FP8_DECODE_STAGES, FP8_DECODE_MAX_REGISTERS = 3, 128


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """How many programs share one sequence's keys in a generation step, so that a
    small batch still fills the GPU (flash-decoding); 1 once the batch does."""
    return max(1, min(16, -(-2 * num_sms // (num_seqs * num_kv_heads))))


if triton is not None:
    from worker.backends.pdl import wait as pdl_wait

    _TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit
    def _e4m3_to_f16(x):  # type: ignore[no-untyped-def]
        """e4m3 codes to fp16, as an operation Triton may not move (is_pure=False).

        Why: P·V contracts over keys, and the MMA wants two keys' values of one dimension in a
        register pair, a tile row apart. Left to itself, Triton moves the e4m3 V tile into the
        MMA's layout first and widens after (past a pure conversion too), gathering single
        bytes from shared memory (64 ld.shared.b8 a thread an iteration); widened first, the
        tile goes through shared memory as fp16 and comes back by ldmatrix.trans. With the
        block table read an iteration ahead, a decode layer over an e4m3 cache on an H200 took
        0.92-0.93x the time from 512 sequences up (1.01x at 128 and 256), FP8 1000/1000 13,496
        -> 13,931 tok/s; each change alone, or K widened first too, was no faster, and prefill
        tiles were slower (bench/results/attention_fp8_v_widen_h200_2026-11-28.txt)."""
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4,
        )  # fmt: skip

    @triton.jit
    def _paged_attention_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, block_tables_ptr, query_start_ptr,
        seq_lens_ptr, tile_seq_ptr, tile_q0_ptr, sinks_ptr, scale, window, softcap, stride_qt, stride_qh,
        stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
        NUM_HEADS: tl.constexpr, USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, COMPUTE: tl.constexpr,
        FP8_DECODE: tl.constexpr, PDL: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    ):  # fmt: skip
        pdl_wait(PDL)
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        if BLOCK_Q == 1:
            # A decode step (every sequence one token): tile, sequence and query row are one
            # index, so the first loads need not wait on the tile map and query starts (two
            # dependent DRAM reads fewer before the first keys). On an H100, e4m3 cache at 512 x 192
            # keys: 96.9 -> 93.7 us a layer; bf16 cache at 64 x 1024: 110.1 -> 95.7; others within 1 %.
            seq, q0, q_begin, q_len = tile, 0, tile, 1
        else:
            seq = tl.load(tile_seq_ptr + tile)
            q0 = tl.load(tile_q0_ptr + tile)
            q_begin = tl.load(query_start_ptr + seq)
            q_len = tl.load(query_start_ptr + seq + 1) - q_begin
        seq_len = tl.load(seq_lens_ptr + seq)
        # Queries are the last q_len tokens of the sequence, positions contiguous.
        first_pos = seq_len - q_len

        offs_m = tl.arange(0, BLOCK_M)
        q_idx = q0 + offs_m // GROUP
        head = kv_head * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
        q_pos = first_pos + q_idx
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM

        q_rows = (q_begin + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh
        q = tl.load(q_ptr + q_rows + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Causal: nothing past the tile's last query; window: nothing before its first.
        kv_end = tl.minimum(seq_len, first_pos + q0 + BLOCK_Q)
        it_begin = 0
        if USE_WINDOW:
            it_begin = tl.maximum(first_pos + q0 - window + 1, 0) // BLOCK_N
        it_end = tl.cdiv(kv_end, BLOCK_N)
        if SPLITS > 1:
            per_split = tl.cdiv(it_end - it_begin, SPLITS)
            it_begin = it_begin + split * per_split
            it_end = tl.minimum(it_end, it_begin + per_split)
        offs_n = tl.arange(0, BLOCK_N)
        table_row = block_tables_ptr + seq * stride_bt
        if FP8_DECODE:
            # Block-table entries one iteration ahead: an iteration's K and V loads need not wait
            # behind a dependent load of the table (see _e4m3_to_f16 for the figures).
            next_pos = it_begin * BLOCK_N + offs_n
            next_phys = tl.load(table_row + next_pos // BLOCK_SIZE, mask=next_pos < kv_end, other=0)
        for it in range(it_begin, it_end):
            k_pos = it * BLOCK_N + offs_n
            in_seq = k_pos < kv_end
            if FP8_DECODE:
                phys = next_phys.to(tl.int64)
                next_pos = k_pos + BLOCK_N
                next_phys = tl.load(table_row + next_pos // BLOCK_SIZE, mask=next_pos < kv_end, other=0)
            else:
                phys = tl.load(table_row + k_pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
            kv_off = (phys * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh)[:, None]
            kv_mask = in_seq[:, None] & d_ok[None, :]
            # An e4m3 cache widens to the compute dtype in registers (a no-op for bf16).
            k = tl.load(k_cache_ptr + kv_off + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_cache_ptr + kv_off + offs_d[None, :], mask=kv_mask, other=0.0)
            v = _e4m3_to_f16(v) if FP8_DECODE else v.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if USE_SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1) (saturates at +-1)
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            ok = (k_pos[None, :] <= q_pos[:, None]) & in_seq[None, :]
            if USE_WINDOW:
                ok = ok & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows that have seen no key yet keep m = -inf; shift by 0 there to avoid nan.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        row_d_ok = row_ok[:, None] & d_ok[None, :]
        if SPLITS == 1:
            if USE_SINKS:  # the head's sink logit joins the denominator (with several splits: in the merge)
                sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
                m_fin = tl.maximum(m_i, sink)
                rescale = tl.exp(m_i - m_fin)
                l_i = l_i * rescale + tl.exp(sink - m_fin)
                acc = acc * rescale[:, None]
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
            out = acc / l_i[:, None]
            o_rows = (q_begin + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh
            tl.store(out_ptr + o_rows + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_d_ok)
        else:
            # Unnormalised partials, merged by _merge_splits_kernel: [T, H, SPLITS, D] and [T, H, SPLITS, 2].
            part = ((q_begin + q_idx) * NUM_HEADS + head) * SPLITS + split
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_d_ok)
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)

    @triton.jit
    def _merge_splits_kernel(  # type: ignore[no-untyped-def]
        part_acc_ptr, part_ml_ptr, sinks_ptr, out_ptr, stride_ot, stride_oh,
        NUM_HEADS: tl.constexpr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        PDL: tl.constexpr, USE_SINKS: tl.constexpr,
    ):  # fmt: skip
        pdl_wait(PDL)
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        base = (tok * NUM_HEADS + head) * SPLITS + offs_s
        m = tl.load(part_ml_ptr + base * 2)
        l = tl.load(part_ml_ptr + base * 2 + 1)  # noqa: E741
        m_max = tl.max(m, 0)
        if USE_SINKS:
            sink = tl.load(sinks_ptr + head).to(tl.float32)
            m_max = tl.maximum(m_max, sink)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp(m - m_max)  # splits that saw no key: exp(-inf) = 0
        acc = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        total = tl.sum(l * w, 0)
        if USE_SINKS:
            total += tl.exp(sink - m_max)
        total = tl.where(total == 0.0, 1.0, total)
        out = tl.sum(acc * w[:, None], 0) / total
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    tile_seq: torch.Tensor,
    tile_q0: torch.Tensor,
    block_q: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    splits: int = 1,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D]; caches [num_blocks, block_size, KVH, D]; int32 metadata on q's device.
    `softcap`: the scores become softcap * tanh(scores / softcap) before the mask. `sinks`
    [H]: a logit per head in each softmax's denominator that weights no value.

    tile_seq / tile_q0 come from `tile_map(query_start, block_q)`. A generation batch
    whose every sequence has the same q <= block_q query tokens (q = 1: decode; q > 1:
    a verification step) uses tile_seq = arange(B), tile_q0 = 0, one tile per
    sequence, and may spread each sequence's keys over `splits` programs (a power of
    two; see decode_splits): a query row that sees no key of a split gets weight 0
    in the merge. With block_q = 1 (decode) the kernel takes that layout as given and
    reads neither the tile map nor the query starts.
    """
    if triton is None:
        raise RuntimeError("paged_attention_triton needs Triton (a CUDA host)")
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    splits = triton.next_power_of_2(splits)
    if splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_tokens, num_heads, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    # tl.dot wants at least 16 rows.
    block_m = max(16, triton.next_power_of_2(block_q * group))
    block_d = triton.next_power_of_2(head_dim)
    grid = (tile_seq.shape[0], num_kv_heads, splits)
    fp8 = k_cache.element_size() == 1
    fp8_decode = fp8 and block_q == 1 and q.dtype != torch.float32
    stages, launch = 2, pdl.options(q.device, num_tokens)
    if fp8 and block_q == 1:
        stages, launch["maxnreg"] = FP8_DECODE_STAGES, FP8_DECODE_MAX_REGISTERS
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_ml, block_tables, query_start, seq_lens, tile_seq, tile_q0,
        q if sinks is None else sinks, scale, sliding_window or 0, softcap or 1.0, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=keys_per_iter(block_d, block_size, fp8_decode), SPLITS=splits,
        NUM_HEADS=num_heads,
        USE_WINDOW=bool(sliding_window), USE_SOFTCAP=softcap is not None, USE_SINKS=sinks is not None,
        # An e4m3 cache is read as fp16: e4m3 widens to fp16 in one packed instruction a pair (to
        # bf16 through float32, an instruction an element), and fp16 holds the queries and
        # probabilities at least as well as bf16. It is what lets the capped registers pay (above),
        # and a prefill tile over an e4m3 cache took 348 against 402 us (32 x 512 tokens).
        COMPUTE=tl.float16 if fp8 and q.dtype != torch.float32 else _TL_DTYPE[q.dtype],
        FP8_DECODE=fp8_decode,
        # float32 caches (parity runs) get full-precision dots, not TF32.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if block_m <= 64 else 8, num_stages=stages, **launch,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, q if sinks is None else sinks, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, SPLITS=splits, HEAD_DIM=head_dim, BLOCK_D=block_d, USE_SINKS=sinks is not None,
            num_warps=4,
            **pdl.options(q.device, num_tokens),
        )  # fmt: skip
    return out


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: one dense masked attention per sequence, in float32 (float64 for float64 q).
    `softcap`: the scores become softcap * tanh(scores / softcap) before the mask. `sinks`
    [H]: a logit per head in each softmax's denominator that weights no value."""
    num_heads = q.shape[1]
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv_heads
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    for i in range(len(seq_lens)):
        a, b = int(query_start[i]), int(query_start[i + 1])
        if a == b:
            continue
        n = int(seq_lens[i])
        blocks = block_tables[i, : math.ceil(n / block_size)]
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qi = q[a:b].transpose(0, 1)  # [H, L, D]
        scores = torch.matmul(qi.to(acc), k.to(acc).transpose(1, 2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(n - (b - a), n, device=q.device)[:, None]
        k_pos = torch.arange(n, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # the sink's column joins the softmax, then is dropped
            sink = sinks.to(acc)[:, None, None].expand(-1, b - a, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[a:b] = torch.matmul(probs, v.to(acc)).transpose(0, 1).to(q.dtype)
    return out
