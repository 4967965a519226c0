"""Prompt log probs (OutputConfig.prompt_log_probs) end to end on the tiny
checkpoint, with transformers as the oracle: each prompt token's log prob given
the tokens before it, and the likeliest tokens at its position."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tests.checkpoints import VOCAB_SIZE
from tests.worker.executor.helpers import _hf_model, run_all
from worker.executor import Executor, ExecutorConfig, KvCacheConfig, OutputConfig, Request, SamplingConfig

# float32 forward passes of two implementations differ by ~1e-5 in the logits.
TOL = 1e-4


def hf_prompt_log_probs(checkpoint: Path, tokens: list[int]) -> np.ndarray:
    """[len(tokens) - 1, vocab]: the log-softmax of the row that predicts each token after the first."""
    import torch

    with torch.no_grad():
        logits = _hf_model(checkpoint)(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)[:-1].numpy()


def executor(checkpoint: Path, max_num_tokens: int) -> Executor:
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=4096)
    return Executor.from_model(checkpoint, ExecutorConfig(backend="numpy", kv_cache_config=kv,
                                                          max_num_tokens=max_num_tokens))  # fmt: skip


@pytest.mark.parametrize("max_num_tokens", [2048, 8], ids=["whole", "chunked"])
def test_prompt_log_probs_match_transformers(tiny_llama: Path, max_num_tokens: int) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(5, VOCAB_SIZE) for _ in range(n)] for n in (1, 2, 19, 33)]
    requests = [Request(input_token_ids=p, max_tokens=2, end_id=-1, num_return_sequences=2 if len(p) == 19 else 1,
                        sampling_config=SamplingConfig(temperature=0.7, seed=1),  # sampling leaves them alone
                        output_config=OutputConfig(prompt_log_probs=3)) for p in prompts]  # fmt: skip
    with executor(tiny_llama, max_num_tokens) as ex:
        results = run_all(ex, requests)
    for p, responses in zip(prompts, results.values(), strict=True):
        finals = [r.result for r in responses if r.result is not None and r.result.is_sequence_final]
        assert all(r.error_msg is None for r in responses)
        got = next(f.prompt_log_probs for f in finals if f.sequence_index == 0)
        assert all(f.prompt_log_probs is None for f in finals if f.sequence_index != 0)  # the prompt's, once
        assert got is not None and len(got.log_probs) == len(p) - 1
        want = hf_prompt_log_probs(tiny_llama, p)
        assert np.allclose(got.log_probs, want[np.arange(len(p) - 1), p[1:]], atol=TOL)
        for position, (ids, lps) in enumerate(zip(got.top_token_ids, got.top_log_probs, strict=True)):
            assert len(ids) == 3
            assert np.allclose(lps, want[position][ids], atol=TOL)
            assert lps[0] >= lps[1] >= lps[2]
            assert lps[2] >= np.sort(want[position])[-3] - TOL  # the three likeliest


def test_prompt_log_probs_of_a_cached_prompt_are_computed_again(tiny_llama: Path) -> None:
    """A prompt whose blocks the prefix cache holds still has every row computed."""
    p = list(range(5, 5 + 24))
    plain = Request(input_token_ids=p, max_tokens=1, end_id=-1)
    scored = Request(input_token_ids=p, max_tokens=1, end_id=-1, output_config=OutputConfig(prompt_log_probs=0))
    with executor(tiny_llama, 2048) as ex:
        run_all(ex, [plain])
        (responses,) = run_all(ex, [scored]).values()
    got = responses[-1].result.prompt_log_probs  # type: ignore[union-attr]
    assert got is not None and got.top_token_ids == [[] for _ in p[1:]]
    want = hf_prompt_log_probs(tiny_llama, p)
    assert np.allclose(got.log_probs, want[np.arange(len(p) - 1), p[1:]], atol=TOL)


def test_prompt_log_probs_out_of_range_are_refused(tiny_llama: Path) -> None:
    with executor(tiny_llama, 2048) as ex:
        (responses,) = run_all(ex, [Request(input_token_ids=[5, 6], max_tokens=1,
                                            output_config=OutputConfig(prompt_log_probs=10**6))]).values()  # fmt: skip
    assert "prompt_log_probs" in (responses[-1].error_msg or "")
