"""Embeddings on CUDA: the torch backend's hidden states (eager, beside steps that run
as CUDA graphs and overlap the host) pooled as transformers' on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.worker.executor.helpers import run_all
from tests.worker.executor.test_embeddings import hf_embedding, prompts
from worker.executor import EmbeddingConfig, Executor, ExecutorConfig, KvCacheConfig, Request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Cosine similarity to the float32 CPU oracle. float32 on the GPU differs by summation order
# (and TF32 where a GEMM uses it: 10 mantissa bits, ~1e-3 relative); bfloat16 keeps 8 bits
# (~4e-3 relative per rounding) through two layers, so its vectors stay within ~1e-2 in angle.
MIN_COSINE = {"float32": 0.9999, "bfloat16": 0.999}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("max_num_tokens", [2048, 16], ids=["whole", "chunked"])
def test_cuda_embeddings_match_transformers_beside_generation(dtype: str, max_num_tokens: int,
                                                               tmp_path: Path) -> None:  # fmt: skip
    checkpoint = make_checkpoint("llama_gqa", tmp_path / "llama")
    config = ExecutorConfig(backend="torch", device="cuda", dtype=dtype, max_num_tokens=max_num_tokens,
                            kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=4096))  # fmt: skip
    generate = [Request(input_token_ids=p, max_tokens=20, end_id=-1) for p in prompts()]
    embed = [Request(input_token_ids=p, max_tokens=1, embedding_config=EmbeddingConfig(pooling))
             for pooling in ("last", "mean") for p in prompts()]  # fmt: skip
    with Executor.from_model(checkpoint, config) as ex:
        alone = run_all(ex, generate)
        mixed = run_all(ex, generate + embed)
        assert ex.core.blocks.num_free == ex.core.blocks.num_blocks
    tokens = [[r.result.output_token_ids for r in rs if r.result] for rs in alone.values()]
    answers = list(mixed.values())
    assert [[r.result.output_token_ids for r in rs if r.result] for rs in answers[: len(generate)]] == tokens
    for request, (response,) in zip(embed, answers[len(generate) :], strict=True):
        assert response.result is not None and response.result.embedding is not None, response.error_msg
        assert request.embedding_config is not None and request.embedding_config.pooling is not None
        want = hf_embedding(checkpoint, request.input_token_ids, request.embedding_config.pooling)
        got = response.result.embedding.astype(np.float64)
        assert abs(np.linalg.norm(got) - 1) < 1e-5
        assert float(got @ want) >= MIN_COSINE[dtype]
