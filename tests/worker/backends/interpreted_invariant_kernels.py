"""Deterministic mode's CUDA kernels run by Triton's interpreter on the CPU: the
invariant GEMM against torch, and the batch invariance itself (a row's output bit for bit
the same alone and among other rows) of the GEMM, the add + RMSNorm and the paged
attention as deterministic mode launches it. Run with TRITON_INTERPRET=1 set before
Triton is imported (test_invariant_kernels_interpreted.py starts this module in a
process of its own).

    TRITON_INTERPRET=1 python -m tests.worker.backends.interpreted_invariant_kernels
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tests.worker.backends.interpreted_kernels import assert_close_sums, run_checks
from worker.backends import invariant_matmul, torch_ops
from worker.backends.paged_attention import PREFILL_BLOCK_Q, paged_attention_triton, tile_map

BATCHES = (1, 7, 64)


def check_matmul_matches_torch() -> None:
    """Whole and ragged tiles in every dimension, K past several BLOCK_K steps, a bias. In
    float32: the interpreter does not run bf16 tiles (tests/gpu/test_deterministic_gpu.py does)."""
    for m, n, k in ((1, 128, 64), (7, 200, 300), (70, 130, 129)):
        x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        magnitude = x.abs() @ w.abs().T
        assert_close_sums(invariant_matmul.matmul_triton(x, w), x @ w.T, magnitude, k)
        assert_close_sums(invariant_matmul.matmul_triton(x, w, b), x @ w.T + b, magnitude + b.abs(), k + 1)


def check_matmul_rows_are_batch_invariant() -> None:
    x, w, b = torch.randn(1, 300), torch.randn(200, 300), torch.randn(200)
    alone = invariant_matmul.matmul_triton(x, w, b)
    for rows in BATCHES:
        # The last row of a batch whose other rows are new each time.
        batch = torch.randn(rows, 300)
        batch[-1] = x[0]
        got = invariant_matmul.matmul_triton(batch, w, b)[-1]
        assert torch.equal(got, alone[0]), f"a row's product changed in a batch of {rows}"


def check_add_rmsnorm_rows_are_batch_invariant() -> None:
    x, r, w = torch.randn(1, 256), torch.randn(1, 256), torch.randn(256)
    alone = torch_ops.add_rmsnorm_triton(x, r.clone(), w, 1e-5)
    for rows in BATCHES:
        xb, rb = torch.randn(rows, 256), torch.randn(rows, 256)
        xb[-1], rb[-1] = x[0], r[0]
        got = torch_ops.add_rmsnorm_triton(xb, rb, w, 1e-5)[-1]
        assert torch.equal(got, alone[0]), f"a row's norm changed in a batch of {rows}"


def _attend(q_lens: list[int], ctx: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            tables: np.ndarray) -> torch.Tensor:  # fmt: skip
    """Attention as deterministic mode launches it: every step in PREFILL_BLOCK_Q tiles."""
    query_start = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int64)
    tile_seq, tile_q0 = tile_map(query_start, PREFILL_BLOCK_Q)
    i32: dict[str, Any] = {"dtype": torch.int32}
    return paged_attention_triton(
        q, k, v, torch.tensor(tables, **i32), torch.tensor(query_start, **i32), torch.tensor(ctx, **i32),
        torch.tensor(tile_seq, **i32), torch.tensor(tile_q0, **i32), PREFILL_BLOCK_Q, 32**-0.5,
    )  # fmt: skip


def check_attention_is_batch_invariant() -> None:
    """A sequence's prefill chunk (19 queries) and its later decode query give the same
    output alone as among 6 others (prefill chunks and decode tokens mixed)."""
    rng = np.random.default_rng(0)
    heads, kv_heads, dim, block = 4, 2, 32, 16
    k, v = torch.randn(40, block, kv_heads, dim), torch.randn(40, block, kv_heads, dim)
    tables = rng.permutation(40)[:35].reshape(7, 5).astype(np.int32)  # 7 sequences of up to 80 keys
    for q_len, ctx in ((19, 19), (1, 70)):
        q = torch.randn(q_len, heads, dim)
        alone = _attend([q_len], [ctx], q, k, v, tables[3:4])
        others = [(int(n), int(n)) if i % 2 else (1, int(n)) for i, n in enumerate(rng.integers(1, 80, 7))]
        others[3] = (q_len, ctx)
        q_lens, ctxs = [a for a, _ in others], [c for _, c in others]
        qs = torch.randn(sum(q_lens), heads, dim)
        start = sum(q_lens[:3])
        qs[start : start + q_len] = q
        batched = _attend(q_lens, ctxs, qs, k, v, tables)[start : start + q_len]
        assert torch.equal(batched, alone), f"{q_len} queries over {ctx} keys changed among other sequences"


CHECKS: list[Callable[[], None]] = [
    check_matmul_matches_torch, check_matmul_rows_are_batch_invariant, check_add_rmsnorm_rows_are_batch_invariant,
    check_attention_is_batch_invariant,
]


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS))
