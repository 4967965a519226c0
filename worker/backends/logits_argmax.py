"""The greedy token and the log-sum-exp of each row of logits, in one pass on CUDA.

Every step's sampler needs, for each row of float32 logits [S, V], the argmax (greedy
rows take it) and log-sum-exp (the chosen token's log prob is its logit minus it). In
torch that is three reductions (argmax, max, sum of exp), each a kernel that, for one
row of a 128k vocabulary, runs on a few SMs: 55 us a step together on the H100 at
batch 1, about 1 % of the 8B's step. Here a row is cut into chunks, one program each, so
that a small batch still spreads over the GPU; each program reduces its chunk, in one
read, to (max, first index of the max, sum of exp(x - max)), and the row's last program
to finish combines the chunks' triples in chunk order (reproducible): one launch.

Ties go to the lowest token id, as torch.argmax has them. A row of -inf only (every token
banned) has log-sum-exp -inf and token 0, as torch gives.

Why hand-written: torch has no fused argmax + log-sum-exp, and its reductions split one
long row over too few blocks; Triton is the backend's kernel language already.
"""

from __future__ import annotations

import torch

from worker.backends.sm_count import num_sms

try:
    import triton  # type: ignore[import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # the CPU host
    triton = None

BLOCK = 2048  # logits a program reads per loop step


def chunks_per_row(rows: int, vocab: int, num_sms: int) -> int:
    """Programs per row: about two per SM over the batch, each with at least one block."""
    return max(1, min(-(-vocab // BLOCK), -(-2 * num_sms // rows), 64))


if triton is not None:

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _merge(best, best_at, total, V):  # type: ignore[no-untyped-def]
        """(max, first index of the max (V: none), sum of exp(x - max)) of several
        (max, index, sum) triples, lanes' or chunks'; a triple of -inf adds nothing."""
        m = tl.max(best, axis=0)
        at = tl.min(tl.where(best == m, best_at, V), axis=0)
        s = tl.sum(tl.where(best > float("-inf"), total * tl.exp(best - m), 0.0), axis=0)
        return m, at, s

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _store_row(ids_ptr, lse_ptr, row, m, at, s, V):  # type: ignore[no-untyped-def]
        tl.store(ids_ptr + row, tl.where(at == V, 0, at).to(tl.int64))
        tl.store(lse_ptr + row, m + tl.log(s))

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _argmax_lse_kernel(  # type: ignore[no-untyped-def]
        logits_ptr, ids_ptr, lse_ptr, part_ptr, counts_ptr, V, stride_row, chunk,
        CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        start = c * chunk
        end = tl.minimum(start + chunk, V)
        # Per lane, in one read of the logits: the max so far, where it was, and the sum of
        # exp(x - that max), rescaled when the max moves (an online softmax's denominator).
        best = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
        best_at = tl.zeros((BLOCK,), dtype=tl.int32)
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(start, end, BLOCK):
            x = tl.load(logits_ptr + row * stride_row + k0 + offs, mask=k0 + offs < end, other=float("-inf"))
            better = x > best  # strictly: an earlier equal value keeps its lower id
            new = tl.where(better, x, best)
            shift = tl.where(new == float("-inf"), 0.0, new)  # a lane that has seen only -inf adds 0
            total = total * tl.exp(best - shift) + tl.exp(x - shift)
            best_at = tl.where(better, k0 + offs, best_at)
            best = new
        m, at, s = _merge(best, best_at, total, V)
        if CHUNKS == 1:
            _store_row(ids_ptr, lse_ptr, row, m, at, s, V)
        else:
            part = part_ptr + (row * CHUNKS + c) * 3
            tl.store(part, m)
            tl.store(part + 1, at.to(tl.float32, bitcast=True))
            tl.store(part + 2, s)
            tl.debug_barrier()  # the triple is written before the count (acq_rel) goes up
            if tl.atomic_add(counts_ptr + row, 1) == CHUNKS - 1:
                each = tl.arange(0, CHUNKS)
                parts = part_ptr + (row * CHUNKS + each) * 3  # .cg: the other programs' triples, from L2
                ms = tl.load(parts, cache_modifier=".cg")
                ats = tl.load(parts + 1, cache_modifier=".cg").to(tl.int32, bitcast=True)
                ss = tl.load(parts + 2, cache_modifier=".cg")
                m, at, s = _merge(ms, ats, ss, V)
                _store_row(ids_ptr, lse_ptr, row, m, at, s, V)
                tl.store(counts_ptr + row, 0)


# Per device: the rows' finished-chunk counts, zero between calls (the kernel leaves them
# so); grown when a call has more rows. The sampler runs eagerly, never in a CUDA graph.
_COUNTS: dict[int, torch.Tensor] = {}


def _chunks(rows: int, vocab: int, sms: int) -> int:
    return int(triton.next_power_of_2(chunks_per_row(rows, vocab, sms)))


def load_kernels(device: torch.device, vocab: int, max_rows: int) -> None:
    """Run once, on a row of zeros, the kernel of every chunk count a step of 1..max_rows
    rows of `vocab` logits uses (CHUNKS is a constant of the kernel: up to seven variants),
    at start-up. A variant's first launch compiles it (0.2-0.3 s on the H100) and then,
    even when compiled ahead (Triton's `warmup`), loads it (CompiledKernel._init_handles:
    the launcher, the module): an 8B's first serving burst, with every variant compiled
    ahead, still spent 260, 93 and 98 ms of host time launching the sampler in the three
    steps that met a new one, 0.5 ms after (17,340 tok/s against 20,589 for the next burst;
    bench/results/start_up_compiles_h100_2026-11-28.txt)."""
    sms = num_sms(device)
    zeros = torch.zeros((1, vocab), dtype=torch.float32, device=device)
    for chunks in sorted({_chunks(rows, vocab, sms) for rows in range(1, max_rows + 1)}):
        _argmax_lse(zeros, chunks)


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits [S, V] on CUDA, rows contiguous -> (argmax int64 [S], log-sum-exp
    float32 [S])."""
    rows, vocab = logits.shape
    return _argmax_lse(logits, _chunks(rows, vocab, num_sms(logits.device)))


def _argmax_lse(logits: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    dev = logits.device.index or 0
    if dev not in _COUNTS or _COUNTS[dev].numel() < rows:
        _COUNTS[dev] = torch.zeros(max(rows, 1024), dtype=torch.int32, device=logits.device)
    chunk = -(-vocab // chunks)
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    parts = torch.empty((rows, chunks, 3), dtype=torch.float32, device=logits.device)
    counts = _COUNTS[dev]
    _argmax_lse_kernel[(rows, chunks)](
        logits, ids, lse, parts, counts, vocab, logits.stride(0), chunk, CHUNKS=chunks, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    return ids, lse
