"""Prompt log probs on the torch backend on CUDA (float32, overlap on, prompts in
chunks) against transformers' log-softmax of the context logits: the rows of each
chunk come to the host and are reduced there to a few numbers a token."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import VOCAB_SIZE, make_checkpoint
from tests.worker.executor.helpers import run_all
from worker.executor import Executor, ExecutorConfig, KvCacheConfig, OutputConfig, Request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
# float32 on two implementations (and TF32 off): logits within ~1e-5.
TOL = 1e-4


def test_prompt_log_probs_match_transformers_on_cuda(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    directory = make_checkpoint("llama_gqa", tmp_path / "llama_gqa")
    rng = random.Random(11)
    prompts = [[rng.randrange(5, VOCAB_SIZE) for _ in range(n)] for n in (2, 37, 100)]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    config = ExecutorConfig(backend="torch", device="cuda", dtype="float32", max_num_tokens=32,
                            kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=4096))  # fmt: skip
    requests = [Request(input_token_ids=p, max_tokens=3, end_id=-1, output_config=OutputConfig(prompt_log_probs=4))
                for p in prompts]  # fmt: skip
    with Executor.from_model(directory, config) as ex:
        results = run_all(ex, requests)
    for p, responses in zip(prompts, results.values(), strict=True):
        got = responses[-1].result.prompt_log_probs  # type: ignore[union-attr]
        with torch.no_grad():
            rows = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), dim=-1)[:-1].numpy()
        assert got is not None and len(got.log_probs) == len(p) - 1
        assert np.allclose(got.log_probs, rows[np.arange(len(p) - 1), p[1:]], atol=TOL)
        for position, (ids, lps) in enumerate(zip(got.top_token_ids, got.top_log_probs, strict=True)):
            assert np.allclose(lps, rows[position][ids], atol=TOL)
            assert lps[-1] >= np.sort(rows[position])[-4] - TOL
