"""The Triton kernels run by Triton's interpreter on the CPU against their torch
twins, in float32 (run with TRITON_INTERPRET=1 set before Triton is imported:
test_kernels_interpreted.py starts this module in a process of its own).

    TRITON_INTERPRET=1 python -m tests.worker.backends.interpreted_kernels
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton  # type: ignore[import-not-found,unused-ignore]

from worker.backends import fp8_gemm, gemv, logits_argmax, quant_linear, torch_ops
from worker.backends.paged_attention import PREFILL_BLOCK_Q, paged_attention_torch, paged_attention_triton, tile_map

ATOL = 1e-5
# float32's unit roundoff: every +, × and exp rounds to within this relative error.
UNIT = torch.finfo(torch.float32).eps / 2


def gamma(terms: int) -> float:
    """The classical bound (Higham, Accuracy and Stability, §3.1) on the relative error of a
    float32 sum or dot product of `terms` terms, whatever order it is summed in: n·u/(1 − n·u),
    relative to the sum of the terms' magnitudes. A CPU's BLAS and Triton's interpreter block
    their sums differently, so two evaluations may differ by up to twice it."""
    return terms * UNIT / (1 - terms * UNIT)


def assert_close_sums(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, terms: int) -> None:
    """Two float32 evaluations of the same sums of `terms` terms (`magnitude`: each sum's
    terms' absolute values, summed) agree within 2·gamma(terms)·magnitude, elementwise."""
    bound = 2 * gamma(terms) * magnitude
    excess = ((got - want).abs() - bound).max().item()
    assert excess <= 0, f"differs by {excess:.3g} beyond the float32 rounding bound of {terms}-term sums"


def check_add_rmsnorm() -> None:
    x, w = torch.randn(7, 256), torch.randn(256)
    for residual in (None, torch.randn(7, 256)):
        r1 = None if residual is None else residual.clone()
        r2 = None if residual is None else residual.clone()
        # The mean of 256 squares is within gamma(257) of itself, its rsqrt within half that; the
        # scalings round a few times more.
        torch.testing.assert_close(torch_ops.add_rmsnorm_triton(x, r1, w, 1e-5),
                                   torch_ops.add_rmsnorm_torch(x, r2, w, 1e-5), atol=ATOL,
                                   rtol=gamma(257) + 8 * UNIT)  # fmt: skip
        if r1 is not None and r2 is not None:
            torch.testing.assert_close(r1, r2)


def check_fp8_outputs() -> None:
    """The norm's and SwiGLU's e4m3 codes and scales equal those the row-quantization
    kernel makes of their output (the pass a projection would otherwise make). Both run
    interpreted: the interpreter's e4m3 rounding is its own (it can differ from torch's by
    an exponent step), so the codes are compared kernel to kernel."""
    x, w, res = torch.randn(5, 256), torch.randn(256), torch.randn(5, 256)
    gate_up = torch.randn(5, 2 * 384) * 3
    for out, codes, scales in (torch_ops.add_rmsnorm_fp8_triton(x, res, w, 1e-5),
                               torch_ops.silu_mul_fp8_triton(gate_up)):  # fmt: skip
        rows, cols = out.shape
        want_codes, want_scales = torch.empty_like(codes), torch.empty_like(scales)
        quant_linear._quant_rows_kernel[(rows,)](out, want_codes, want_scales, cols, out.stride(0),
                                                 BLOCK=triton.next_power_of_2(cols))  # fmt: skip
        torch.testing.assert_close(scales, want_scales, atol=0, rtol=0)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), "e4m3 codes differ"
    torch.testing.assert_close(torch_ops.silu_mul_fp8_triton(gate_up)[0], torch_ops.silu_mul_torch(gate_up),
                               atol=ATOL, rtol=1e-5)  # fmt: skip


def check_fp8_gemm() -> None:
    """Every tile of the Triton FP8 GEMM (split ones too) against the product of the
    dequantized codes, with rows and outputs that leave partial tiles."""
    for m in (3, 70):
        x, w = torch.randn(m, 1024), torch.randn(200, 1024)
        xq, x_scale = quant_linear.quantize_rows_fp8(x)
        w_scale = w.abs().amax(dim=1)[None, :] / 448.0
        wq = (w / w_scale.t()).to(torch.float8_e4m3fn)
        want = (xq.float() * x_scale) @ (wq.float() * w_scale.t()).t()
        # The reference rounds each dequantized value and product (3 roundings a term), the kernel
        # its two scalings (2 more a sum): bound both as sums of k + 3 terms.
        magnitude = (xq.float() * x_scale).abs() @ (wq.float() * w_scale.t()).abs().t()
        for tile in fp8_gemm.TILES:
            got = fp8_gemm.fp8_matmul(xq, x_scale, wq, w_scale, torch.float32, tile)
            assert_close_sums(got, want, magnitude, 1024 + 3)


def check_gemv() -> None:
    """Whole tiles, a ragged last tile, and a row shorter than one tile (its first tile is
    read apart from the loop); with a bias, and float32 out."""
    for n, k in ((12, 1024), (9, 1300), (5, 300)):
        x, w, b = torch.randn(1, k), torch.randn(n, k), torch.randn(n)
        magnitude = x.abs() @ w.abs().T
        assert_close_sums(gemv.gemv(x, w), x @ w.T, magnitude, k)
        assert_close_sums(gemv.gemv(x, w, b, out_dtype=torch.float32), x @ w.T + b, magnitude + b.abs(), k + 1)


def check_gemv_swiglu() -> None:
    """The gate_up GEMV with SwiGLU in its epilogue against gemv then silu_mul: whole tiles,
    a ragged last tile, rows shorter than a tile, a row count no multiple of the block."""
    for n, k in ((8, 1024), (6, 1300), (3, 300)):
        x, w = torch.randn(1, k), torch.randn(2 * n, k)
        # silu(g)·u moves by at most |silu'| ≤ 1.1 times g's error times |u|, plus |silu(g)| ≤ |g|
        # times u's error; silu and the product round a few times more.
        gate_up, magnitude = x @ w.T, x.abs() @ w.abs().T
        err = 2 * gamma(k) * magnitude
        (g, u), (g_err, u_err) = gate_up.chunk(2, dim=-1), err.chunk(2, dim=-1)
        want = torch_ops.silu_mul_torch(gate_up)
        bound = 1.1 * g_err * (u.abs() + u_err) + (g.abs() + g_err) * u_err + 8 * UNIT * want.abs()
        excess = ((gemv.gemv_swiglu(x, w) - want).abs() - bound).max().item()
        assert excess <= 0, f"gemv_swiglu differs by {excess:.3g} beyond the float32 rounding bound"


def assert_close_lse(lse: torch.Tensor, x: torch.Tensor) -> None:
    """log Σ exp(x − max) sums `vocab` positive terms, each exp within a few roundings: the sum is
    within gamma(vocab + 4) of itself, relatively, so its log within that, absolutely."""
    torch.testing.assert_close(lse, torch.logsumexp(x, dim=-1), atol=2 * gamma(x.shape[-1] + 4), rtol=4 * UNIT)


def check_argmax_logsumexp() -> None:
    """Rows cut into chunks (the last program of a row combines them) and whole rows; ties
    across chunks go to the lowest id; a row of -inf only gives token 0 and -inf."""
    for rows, vocab in ((1, 10000), (3, 5000), (16, 3000)):
        x = torch.randn(rows, vocab)
        x[0, 9 * vocab // 10] = x[0, vocab // 10] = 10.0  # a tie, in different chunks
        x[-1] = float("-inf")
        ids, lse = logits_argmax.argmax_logsumexp(x)
        assert torch.equal(ids, x.argmax(dim=-1)), (rows, vocab)
        assert_close_lse(lse, x)
    assert not logits_argmax._COUNTS[0].any()


def check_argmax_at_every_chunk_count() -> None:
    """One row cut into any of the chunk counts a batch size may use gives torch's argmax
    and log-sum-exp (load_kernels runs every count on one row), and leaves the counters at
    zero, load_kernels too."""
    x = torch.randn(1, 5000)
    for chunks in (1, 2, 4, 8, 16, 32, 64):
        ids, lse = logits_argmax._argmax_lse(x, chunks)
        assert torch.equal(ids, x.argmax(dim=-1)), chunks
        assert_close_lse(lse, x)
    logits_argmax.load_kernels(torch.device("cpu"), 5000, 300)
    assert not logits_argmax._COUNTS[0].any()


def check_silu_mul() -> None:
    gu = torch.randn(5, 2 * 384)
    torch.testing.assert_close(torch_ops.silu_mul_triton(gu), torch_ops.silu_mul_torch(gu), atol=ATOL, rtol=1e-5)


def check_rope_and_cache() -> None:
    heads, kv_heads, dim = 4, 2, 32
    for t in (9, 70):  # a few tokens (2 heads a program), many (16 heads a program)
        qkv = torch.randn(t, (heads + 2 * kv_heads) * dim)
        pos = torch.randint(0, 100, (t,), dtype=torch.int32)
        cos_sin = torch.randn(128, dim)
        slots = torch.randperm(32 * 4)[:t].to(torch.int32)
        caches = [torch.zeros(32, 4, kv_heads, dim) for _ in range(4)]
        q1 = torch_ops.rope_and_cache_triton(qkv.clone(), pos, cos_sin, caches[0], caches[1], slots, heads,
                                             kv_heads, dim)  # fmt: skip
        q2 = torch_ops.rope_and_cache_torch(qkv.clone(), pos, cos_sin, caches[2], caches[3], slots, heads,
                                            kv_heads, dim)  # fmt: skip
        torch.testing.assert_close(q1, q2, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(caches[0], caches[2], atol=ATOL, rtol=1e-5)
        assert torch.equal(caches[1], caches[3])


@dataclass(frozen=True, slots=True)
class PagedCase:
    """Three sequences' queries and their paged KV (blocks in a random order), as the
    Triton kernel and the torch reference take them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tables: np.ndarray
    query_start: np.ndarray
    ctx: np.ndarray
    block_q: int

    @classmethod
    def make(cls, rng: np.random.Generator, ctx: np.ndarray, q_lens: np.ndarray, heads: int, kv_heads: int,
             dim: int, block: int, decode: bool, scale_qk: float = 1.0) -> PagedCase:  # fmt: skip
        per_seq = -(-ctx // block)
        num_blocks = int(per_seq.sum()) + 1
        perm = rng.permutation(num_blocks)
        tables = np.zeros((len(ctx), int(per_seq.max())), dtype=np.int32)
        start = 0
        for i, nb in enumerate(per_seq):
            tables[i, :nb] = perm[start : start + nb]
            start += nb
        k, v = torch.randn(num_blocks, block, kv_heads, dim) * scale_qk, torch.randn(num_blocks, block, kv_heads, dim)
        query_start = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int64)
        q = torch.randn(int(query_start[-1]), heads, dim) * scale_qk
        return cls(q, k, v, tables, query_start, ctx, 1 if decode else PREFILL_BLOCK_Q)

    def triton(self, scale: float, window: int | None, splits: int, **variant: Any) -> torch.Tensor:
        """The Triton kernel's output (`variant`: softcap, sinks)."""
        tile_seq, tile_q0 = tile_map(self.query_start, self.block_q)
        i32: dict[str, Any] = {"dtype": torch.int32}
        out = torch.full_like(self.q, float("nan"))
        paged_attention_triton(
            self.q, self.k, self.v, torch.tensor(self.tables, **i32), torch.tensor(self.query_start, **i32),
            torch.tensor(self.ctx, **i32), torch.tensor(tile_seq, **i32), torch.tensor(tile_q0, **i32), self.block_q,
            scale, window, out=out, splits=splits, **variant,
        )  # fmt: skip
        return out

    def reference(self, scale: float, *args: Any, abs_v: bool = False, **kwargs: Any) -> torch.Tensor:
        """The torch reference (with `abs_v`: over |v|, the spread assert_close_attention takes)."""
        tables = torch.tensor(self.tables, dtype=torch.int64)
        v = self.v.abs() if abs_v else self.v
        return paged_attention_torch(self.q, self.k, v, tables, self.query_start, self.ctx, scale, *args, **kwargs)


def check_paged_attention() -> None:
    rng = np.random.default_rng(0)
    heads, kv_heads, dim, block = 4, 2, 32, 16
    scale = dim**-0.5
    for decode, splits in ((True, 1), (True, 2), (False, 1)):
        ctx = rng.integers(1, 70, 3)
        q_lens = np.ones(3, dtype=np.int64) if decode else np.minimum(ctx, rng.integers(1, 20, 3))
        case = PagedCase.make(rng, ctx, q_lens, heads, kv_heads, dim, block, decode)
        out = case.triton(scale, None, splits)
        ref, spread = case.reference(scale), case.reference(scale, abs_v=True)
        assert_close_attention(out, ref, spread, case.q, case.k, scale, int(ctx.max()))


def assert_close_attention(out: torch.Tensor, ref: torch.Tensor, spread: torch.Tensor, q: torch.Tensor,
                           k: torch.Tensor, scale: float, keys: int) -> None:  # fmt: skip
    """Two float32 evaluations of attention over up to `keys` keys (`spread`: Σ p·|v|, the
    reference's weights over |v|). A score is a head_dim-term dot product, within
    gamma(dim)·scale·Σ|q||k| (bounded by its largest terms; a soft-cap only shrinks errors);
    a weight's relative error is at most twice the scores' (its own and the normaliser's) plus
    the normalising sum's over the keys; the output moves by that times Σ p·|v|, plus the
    weighted sum's own rounding."""
    dim = q.shape[-1]
    score_err = gamma(dim) * scale * dim * q.abs().max().item() * k.abs().max().item()
    weight_err = 4 * score_err + 2 * gamma(keys + 4)
    excess = ((out - ref).abs() - (weight_err + 2 * gamma(keys)) * spread).max().item()
    assert excess <= 0, f"paged attention differs by {excess:.3g} beyond the float32 rounding bound"


def check_paged_attention_softcap_window() -> None:
    """Scores soft-capped (Gemma 2) under a sliding window shorter than the contexts, in
    decode, split decode and prefill tiles."""
    rng = np.random.default_rng(1)
    heads, kv_heads, dim, block, window, cap = 4, 2, 16, 4, 6, 1.5
    ctx = np.array([9, 23, 14])
    for decode, splits in ((True, 1), (True, 2), (False, 1)):
        q_lens = np.ones(3, dtype=np.int64) if decode else np.array([9, 7, 5])
        case = PagedCase.make(rng, ctx, q_lens, heads, kv_heads, dim, block, decode, scale_qk=2.0)
        out = case.triton(0.3, window, splits, softcap=cap)
        ref, spread = case.reference(0.3, window, cap), case.reference(0.3, window, cap, abs_v=True)
        assert_close_attention(out, ref, spread, case.q, case.k, 0.3, window)
        assert not torch.allclose(out, case.reference(0.3, window), atol=1e-3), "the cap changed nothing"


def check_paged_attention_sinks() -> None:
    """A sink logit per head in every denominator (gpt-oss), under a window, in decode,
    split decode (the sinks join in the merge) and prefill tiles."""
    rng = np.random.default_rng(2)
    heads, kv_heads, dim, block, window = 4, 2, 16, 4, 6
    ctx = np.array([9, 23, 14])
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    for decode, splits in ((True, 1), (True, 2), (False, 1)):
        q_lens = np.ones(3, dtype=np.int64) if decode else np.array([9, 7, 5])
        case = PagedCase.make(rng, ctx, q_lens, heads, kv_heads, dim, block, decode)
        out = case.triton(0.3, window, splits, sinks=sinks)
        ref = case.reference(0.3, window, sinks=sinks)
        spread = case.reference(0.3, window, sinks=sinks, abs_v=True)
        assert_close_attention(out, ref, spread, case.q, case.k, 0.3, window)
        assert not torch.allclose(out, case.reference(0.3, window), atol=1e-3), "the sinks changed nothing"


CHECKS: list[Callable[[], None]] = [
    check_add_rmsnorm, check_fp8_outputs, check_fp8_gemm, check_gemv, check_gemv_swiglu, check_argmax_logsumexp,
    check_argmax_at_every_chunk_count, check_silu_mul, check_rope_and_cache, check_paged_attention,
    check_paged_attention_softcap_window, check_paged_attention_sinks,
]


def run_checks(checks: list[Callable[[], None]]) -> int:
    """Each check in turn, in Triton's interpreter (the exit status of a script)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: the kernels must run in Triton's interpreter", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    for check in checks:
        check()
        print(f"{check.__name__}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS))
