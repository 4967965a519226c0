"""Speculative decoding on the torch CUDA backend (overlap scheduling on, CUDA
graphs for plain steps, verification steps eager): float32 greedy and seeded
sampling token-identical with speculation on and off, each draft source, mixed
batches; the draft model on CUDA with its own graphs and KV."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint
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
