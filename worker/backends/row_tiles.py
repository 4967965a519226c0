"""Matrix products on the CPU whose every row comes out bit for bit the same whatever
the batch (deterministic mode; the CUDA twin is invariant_matmul.py).

A BLAS library picks its kernel, blocking and thread split from the shape, so one row of
`x @ W` can differ in its low bits between a batch of 1 (a GEMV) and a batch of 32 (a
blocked GEMM). Here the rows go through the library in calls of exactly ROW_TILE rows,
the last zero-padded: every call has the same shape, so each row's dot products are
reduced in the same order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# Small enough that a one-row decode step wastes little; a multiple of every CPU GEMM
# micro-tile height in use, so no row of a full tile falls on a kernel's edge path.
ROW_TILE = 16


def matmul_rows_numpy(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [M, K] float32 @ weight [K, N] → [M, N] float32, ROW_TILE rows per call."""
    m, k = x.shape
    out = np.empty((m, weight.shape[1]), dtype=np.float32)
    x = np.ascontiguousarray(x)
    full = m - m % ROW_TILE
    for start in range(0, full, ROW_TILE):
        np.matmul(x[start : start + ROW_TILE], weight, out=out[start : start + ROW_TILE])
    if full < m:
        padded = np.zeros((ROW_TILE, k), dtype=x.dtype)
        padded[: m - full] = x[full:]
        out[full:] = (padded @ weight)[: m - full]
    return out


def linear_rows_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """F.linear in ROW_TILE-row calls. The bias is added after the product, row by row, so it
    changes no order."""
    import torch
    import torch.nn.functional as F

    m, k = x.shape
    out = x.new_empty((m, weight.shape[0]), dtype=out_dtype or x.dtype)
    x = x.contiguous()
    full = m - m % ROW_TILE

    def product(rows: torch.Tensor) -> torch.Tensor:
        if out.dtype == x.dtype:
            return F.linear(rows, weight)
        return torch.mm(rows, weight.t()).to(out.dtype)

    for start in range(0, full, ROW_TILE):
        out[start : start + ROW_TILE] = product(x[start : start + ROW_TILE])
    if full < m:
        padded = x.new_zeros((ROW_TILE, k))
        padded[: m - full] = x[full:]
        out[full:] = product(padded)[: m - full]
    if bias is not None:
        out += bias
    return out
