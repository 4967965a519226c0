"""The torch paged-attention reference (the CPU path, and the oracle for the Triton kernel,
see tests/gpu) against dense float64 attention written out from scratch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.backends.paged_attention import paged_attention_torch, tile_map


def random_paged_case(
    rng: np.random.Generator,
    q_lens: list[int],
    ctx_lens: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    bs: int,
) -> dict[str, object]:
    """Sequences with KV already in scattered cache blocks; queries are the last q_len tokens."""
    num_blocks = sum(-(-n // bs) for n in ctx_lens) + 3
    perm = rng.permutation(num_blocks)
    k_cache = torch.from_numpy(rng.standard_normal((num_blocks, bs, kv_heads, dim)))
    v_cache = torch.from_numpy(rng.standard_normal((num_blocks, bs, kv_heads, dim)))
    width = max(-(-n // bs) for n in ctx_lens)
    tables = np.zeros((len(ctx_lens), width), dtype=np.int64)
    used = 0
    for i, n in enumerate(ctx_lens):
        nb = -(-n // bs)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    query_start = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int64)
    q = torch.from_numpy(rng.standard_normal((int(query_start[-1]), heads, dim)))
    return {
        "q": q,
        "k": k_cache,
        "v": v_cache,
        "tables": tables,
        "qs": query_start,
        "lens": np.asarray(ctx_lens),
    }


def dense_reference(case: dict[str, object], window: int | None) -> np.ndarray:
    q, k, v = (np.asarray(case[x]) for x in ("q", "k", "v"))
    tables, qs, lens = (np.asarray(case[x]) for x in ("tables", "qs", "lens"))
    heads, kv_heads, dim, bs = q.shape[1], k.shape[2], q.shape[2], k.shape[1]
    out = np.zeros_like(q)
    for i, n in enumerate(lens):
        keys = np.stack([k[tables[i, p // bs], p % bs] for p in range(n)])  # [n, KVH, D]
        vals = np.stack([v[tables[i, p // bs], p % bs] for p in range(n)])
        q_len = qs[i + 1] - qs[i]
        for j in range(q_len):
            pos = n - q_len + j
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                lo = 0 if window is None else max(0, pos - window + 1)
                s = keys[lo : pos + 1, kvh] @ q[qs[i] + j, h] / np.sqrt(dim)
                p = np.exp(s - s.max())
                out[qs[i] + j, h] = (p / p.sum()) @ vals[lo : pos + 1, kvh]
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "window"),
    [(4, 4, None), (8, 2, None), (6, 1, None), (4, 2, 5)],
)
def test_reference_matches_dense_attention(heads: int, kv_heads: int, window: int | None) -> None:
    rng = np.random.default_rng(heads * 10 + kv_heads)
    # a long prefill, a chunk on a cached prefix, two generation tokens
    case = random_paged_case(rng, [11, 6, 1, 1], [11, 19, 1, 23], heads, kv_heads, 16, 4)
    got = paged_attention_torch(
        case["q"], case["k"], case["v"], torch.from_numpy(case["tables"]), case["qs"], case["lens"],  # type: ignore[arg-type]
        16**-0.5, window,
    )  # fmt: skip
    np.testing.assert_allclose(got.numpy(), dense_reference(case, window), rtol=1e-10, atol=1e-10)


def test_tile_map_covers_every_query_once() -> None:
    query_start = np.array([0, 1, 18, 18, 50, 51])
    seq, q0 = tile_map(query_start, 16)
    covered = [(int(s), int(q0_) + j) for s, q0_ in zip(seq, q0, strict=True) for j in range(16)]
    q_lens = np.diff(query_start)
    want = {(i, j) for i, n in enumerate(q_lens) for j in range(n)}
    assert want <= set(covered)
    assert all(j < q_lens[s] + 15 for s, j in covered)  # no tile starts past its sequence
    assert list(seq) == [0, 1, 1, 3, 3, 4]
