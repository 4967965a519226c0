"""Speculative decoding on the torch CUDA backend (overlap scheduling on, CUDA
graphs for plain and verification steps): float32 greedy and seeded sampling
token-identical with speculation on and off, each draft source, mixed batches,
with a bounded set of verification graphs; the draft model on CUDA with its own
graphs and KV; the attention kernel on verification-shaped steps (q query tokens
per sequence, padded, split-KV); and in bf16, where a verification forward rounds
differently from single-token steps, greedy output identical except at near-ties."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.checkpoints import make_checkpoint
from worker.backends.cuda_graphs import MAX_QUERY, batch_buckets
from worker.backends.paged_attention import paged_attention_torch, paged_attention_triton
from worker.backends.torch_backend import TorchBackend
from worker.executor import (
    DraftSource,
    EngineCore,
    ExecutorConfig,
    KvCacheConfig,
    Request,
    SamplingConfig,
    SpeculativeConfig,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _tokens(core: EngineCore, requests: list[Request]) -> tuple[dict[int, list[int]], int, int]:
    tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    drafted = accepted = 0
    core.add_requests(enumerate(requests))
    while core.has_work:
        out = core.step()
        for r in out.all_responses():
            assert r.result is not None, r.error_msg
            tokens[r.request_id] += r.result.output_token_ids[0]
        for it in out.iteration_stats:
            drafted += it.num_draft_tokens
            accepted += it.num_accepted_draft_tokens
    core.blocks.check_invariants([])
    return tokens, drafted, accepted


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_speculation_on_cuda_gives_ordinary_decodings_tokens(tmp_path: Path, sampled: bool) -> None:
    model = make_checkpoint("llama_gqa", tmp_path / "llama")
    cfg = ExecutorConfig(backend="torch", device="cuda", dtype="float32", max_num_tokens=256, max_batch_size=16,
                         kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=8192))
    body = [[7 + (3 * i + j) % 300 for j in range(5 + i)] for i in range(8)]
    prompts = [b + b + b[:2] for b in body]

    def requests(spec: SpeculativeConfig | None, want: dict[int, list[int]] | None = None) -> list[Request]:
        out = []
        for i, p in enumerate(prompts):
            s = spec
            if spec is not None and spec.source is DraftSource.DRAFT_TOKENS and want is not None:
                s = SpeculativeConfig(DraftSource.DRAFT_TOKENS, 6, draft_tokens=[*want[i][:9], 0, *want[i][10:]])
            sampling = SamplingConfig(temperature=0.8, top_k=16, seed=i) if sampled else SamplingConfig()
            out.append(Request(input_token_ids=p, max_tokens=32, end_id=-1, sampling_config=sampling,
                               speculative_config=s if i % 2 == 0 else None))
        return out

    want, _, _ = _tokens(EngineCore.from_model(model, cfg), requests(None))
    for spec, draft in ((SpeculativeConfig(DraftSource.PROMPT_LOOKUP, 8), None),
                        (SpeculativeConfig(DraftSource.DRAFT_TOKENS, 6), None),
                        (SpeculativeConfig(DraftSource.DRAFT_MODEL, 4), str(model))):
        core = EngineCore.from_model(model, replace(cfg, draft_model=draft))
        got, drafted, accepted = _tokens(core, requests(spec, want))
        assert got == want, spec.source
        assert drafted > 0
        if spec.source is not DraftSource.PROMPT_LOOKUP:
            assert accepted > 0
        check_verification_graphs(core.backend)


def check_verification_graphs(backend: object) -> None:
    """Verification steps ran in CUDA graphs, and no more shapes were captured than the bound."""
    assert isinstance(backend, TorchBackend)
    verify = [(b, q) for b, q in backend.graph_shapes if q > 1]
    assert verify, "no verification step ran in a CUDA graph"
    assert all(2 <= q <= MAX_QUERY for _, q in verify)
    buckets = [b for b in batch_buckets(16) if b <= 16]  # max_batch_size 16 in these tests
    assert len(verify) <= len(buckets) * (MAX_QUERY - 1)
    assert {b for b, _ in verify} <= set(buckets)


def test_verification_graphs_captured_ahead_stay_bounded(tmp_path: Path) -> None:
    model = make_checkpoint("llama_gqa", tmp_path / "llama")
    backend = TorchBackend.from_checkpoint(model, device="cuda", dtype="float32", max_num_tokens=100,
                                           max_graph_batch=16, max_verify_graph_batch=16)  # fmt: skip
    backend.allocate_kv_cache(num_blocks=64, block_size=16)
    backend.capture_verification_graphs(64)
    shapes = [(b, q) for b, q in backend.graph_shapes if q > 1]
    # Buckets 1, 2, 4, 8, 16 and q = 2 .. 9, less those past 100 tokens (16 x 7, 16 x 8, 16 x 9).
    assert len(shapes) == 5 * (MAX_QUERY - 1) - 3
    assert all(b * q <= 100 for b, q in shapes)
    backend.capture_verification_graphs(64)
    assert [(b, q) for b, q in backend.graph_shapes if q > 1] == shapes


# bf16 inputs: bf16 P·V operands (test_paged_attention_gpu.py); float32: IEEE dots.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [1, 4, 16])
def test_attention_on_a_padded_verification_step(dtype: torch.dtype, splits: int) -> None:
    """What a verification graph feeds the kernel: every sequence padded to q query
    tokens with its KV length raised by its padding, one tile per sequence, split-KV;
    its real rows against the reference on the unpadded step."""
    rng = np.random.default_rng(splits)
    heads, kv_heads, head_dim, block_size, q = 9, 3, 64, 16, MAX_QUERY
    q_lens = np.array([q, 1, 3, q, 2, 5], dtype=np.int64)
    n = len(q_lens)
    ctx = q_lens + rng.integers(0, 400, n)
    blocks = -(-ctx // block_size)
    num_blocks = int(blocks.sum()) + 3
    perm = rng.permutation(num_blocks)
    width = int(-(-(ctx + q).max() // block_size)) + 1  # room for the raised lengths
    tables = np.zeros((n, width), dtype=np.int32)
    used = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    dev = "cuda"
    i32: dict[str, Any] = {"dtype": torch.int32, "device": dev}
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=dev).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=dev).to(dtype)
    padded = torch.randn(n * q, heads, head_dim, device=dev).to(dtype)
    out = torch.full_like(padded, float("nan"))
    paged_attention_triton(
        padded, k, v, torch.tensor(tables, **i32), torch.arange(0, (n + 1) * q, q, **i32),
        torch.tensor(ctx + (q - q_lens), **i32), torch.arange(n, **i32), torch.zeros(n, **i32),
        q, head_dim**-0.5, None, out=out, splits=splits,
    )  # fmt: skip
    torch.cuda.synchronize()
    real = np.concatenate([np.arange(i * q, i * q + m) for i, m in enumerate(q_lens)])
    query_start = np.concatenate(([0], np.cumsum(q_lens)))
    ref = paged_attention_torch(
        padded[real].float(), k.float(), v.float(), torch.tensor(tables, dtype=torch.int64, device=dev),
        query_start, ctx, head_dim**-0.5,
    )  # fmt: skip
    got = out[real].float()
    assert not got.isnan().any(), "real rows left unwritten"
    err = float((got - ref).norm() / ref.norm())
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


# A bf16 divergence must sit where float32 logits give the two tokens nearly the same
# score: the logits of a (k + 1)-token forward and of single-token steps differ by
# bf16 rounding (GEMM shapes pick different cuBLAS kernels, attention splits differ),
# a few units of bf16's 2^-8 relative step of the largest logit.
NEAR_TIE = 0.02  # of the largest |logit|


def test_bf16_greedy_speculation_differs_only_at_near_ties(tmp_path: Path) -> None:
    model = make_checkpoint("llama_gqa", tmp_path / "llama")
    cfg = ExecutorConfig(backend="torch", device="cuda", dtype="bfloat16", max_num_tokens=256, max_batch_size=16,
                         kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=8192))
    body = [[7 + (5 * i + 3 * j) % 300 for j in range(6 + i)] for i in range(8)]
    prompts = [b + b + b[:2] for b in body]

    def requests(spec: SpeculativeConfig | None) -> list[Request]:
        return [Request(input_token_ids=p, max_tokens=48, end_id=-1, speculative_config=spec) for p in prompts]

    want, _, _ = _tokens(EngineCore.from_model(model, cfg), requests(None))
    core = EngineCore.from_model(model, cfg)
    got, drafted, _ = _tokens(core, requests(SpeculativeConfig(DraftSource.PROMPT_LOOKUP, 8)))
    assert drafted > 0
    check_verification_graphs(core.backend)
    reference = TorchBackend.from_checkpoint(model, device="cuda", dtype="float32", use_cuda_graphs=False)
    margins = []
    for i, p in enumerate(prompts):
        first = next((j for j, (a, b) in enumerate(zip(want[i], got[i], strict=True)) if a != b), None)
        if first is None:
            continue
        margins.append(float32_margin(reference, p + want[i][:first], want[i][first], got[i][first]))
    print(f"bf16: {len(margins)} of {len(prompts)} requests differ; float32 margins there (of max |logit|) {margins}")
    assert all(m < NEAR_TIE for m in margins), margins


def float32_margin(backend: TorchBackend, tokens: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| / max |logit| of the next token after `tokens`, in float32."""
    from worker.backends.base import ForwardBatch

    backend.allocate_kv_cache(num_blocks=-(-len(tokens) // 16) + 1, block_size=16)
    n = len(tokens)
    blocks = np.arange(-(-n // 16), dtype=np.int64)
    positions = np.arange(n, dtype=np.int64)
    batch = ForwardBatch(
        token_ids=np.asarray(tokens, dtype=np.int64), positions=positions, query_start=np.array([0, n]),
        context_lens=np.array([n]), block_tables=blocks[None, :], slot_mapping=positions,
        logits_indices=np.array([n - 1]),
    )  # fmt: skip
    logits = backend.logits_to_host(backend.forward(batch))[0]
    return abs(float(logits[a]) - float(logits[b])) / float(np.abs(logits).max())
