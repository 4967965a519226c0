"""Embedding requests (Request.embedding_config) on the tiny checkpoint, with
transformers as the oracle: its final hidden state (LlamaModel's output, after the
last norm), pooled and normalised the same way."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.checkpoints import VOCAB_SIZE
from tests.worker.executor.helpers import _hf_model, run_all
from worker.executor import EmbeddingConfig, EngineCore, Executor, ExecutorConfig, FinishReason, KvCacheConfig, Request
from worker.models.pooling import checkpoint_pooling

# Both sides compute in float32 (epsilon 1.2e-7). Each layer's sums run over at most 128
# terms (hidden 64, intermediate 128), so two orders of summation differ by ~1e-6 relative
# after the model's two layers; on unit vectors whose entries are ~0.1, 1e-5 absolute is
# ten times that and far below what a wrong pooling or a missing norm changes (~1e-1).
TOL = 1e-5


def hf_embedding(checkpoint: Path, tokens: list[int], pooling: str) -> np.ndarray:
    import torch

    with torch.no_grad():
        hidden = _hf_model(checkpoint).model(torch.tensor([tokens])).last_hidden_state[0].double()
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return (pooled / pooled.norm()).numpy()


def executor(checkpoint: Path, max_num_tokens: int = 2048, backend: str = "numpy") -> Executor:
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=4096)
    device = "cpu" if backend == "torch" else None
    return Executor.from_model(checkpoint, ExecutorConfig(backend=backend, device=device, kv_cache_config=kv,
                                                          max_num_tokens=max_num_tokens))  # fmt: skip


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(5, VOCAB_SIZE) for _ in range(n)] for n in (1, 3, 19, 40)]


def embed(ex: Executor, tokens: list[list[int]], pooling: str | None) -> list[np.ndarray]:
    requests = [Request(input_token_ids=p, max_tokens=1, embedding_config=EmbeddingConfig(pooling)) for p in tokens]
    vectors = []
    for responses in run_all(ex, requests).values():
        (response,) = responses  # one final answer, nothing streamed
        assert response.result is not None, response.error_msg
        assert response.result.is_final and response.result.output_token_ids == [[]]
        assert response.result.finish_reasons == [FinishReason.LENGTH]
        assert response.result.embedding is not None and response.result.embedding.dtype == np.float32
        vectors.append(response.result.embedding)
    return vectors


@pytest.mark.parametrize("max_num_tokens", [2048, 8], ids=["whole", "chunked"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers(tiny_llama: Path, pooling: str, max_num_tokens: int) -> None:
    with executor(tiny_llama, max_num_tokens) as ex:
        got = embed(ex, prompts(), pooling)
    for p, vector in zip(prompts(), got, strict=True):
        assert vector.shape == (64,)
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-6
        np.testing.assert_allclose(vector, hf_embedding(tiny_llama, p, pooling), atol=TOL, rtol=0)


def test_embeddings_on_the_torch_backend_match_transformers(tiny_llama: Path) -> None:
    pytest.importorskip("torch")
    with executor(tiny_llama, 8, backend="torch") as ex:
        got = embed(ex, prompts(), "mean") + embed(ex, prompts(), "last")
    want = [hf_embedding(tiny_llama, p, pooling) for pooling in ("mean", "last") for p in prompts()]
    for vector, expected in zip(got, want, strict=True):
        np.testing.assert_allclose(vector, expected, atol=TOL, rtol=0)


def test_embeddings_beside_generation_leave_both_right(tiny_llama: Path) -> None:
    """Generation sharing the engine's steps gives its tokens as alone, and every KV block
    an embedding took is back in the pool."""
    p = prompts()
    generate = Request(input_token_ids=p[2], max_tokens=12, end_id=-1)
    with executor(tiny_llama, 16) as ex:
        (alone,) = run_all(ex, [generate]).values()
        mixed = run_all(ex, [generate] + [Request(input_token_ids=t, max_tokens=1,
                                                  embedding_config=EmbeddingConfig("last")) for t in p])
        free = ex.core.blocks.num_free
        total = ex.core.blocks.num_blocks
    responses = list(mixed.values())
    assert [r.result.output_token_ids for r in responses[0]] == [r.result.output_token_ids for r in alone]  # type: ignore[union-attr]
    for tokens, (r,) in zip(p, responses[1:], strict=True):
        assert r.result is not None and r.result.embedding is not None
        np.testing.assert_allclose(r.result.embedding, hf_embedding(tiny_llama, tokens, "last"), atol=TOL, rtol=0)
    assert free == total


def test_the_checkpoints_pooling_config_is_followed(tiny_llama: Path, tmp_path: Path) -> None:
    checkpoint = shutil.copytree(tiny_llama, tmp_path / "mean_pooled")
    (checkpoint / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))  # fmt: skip
    (checkpoint / "1_Pooling").mkdir()
    (checkpoint / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))  # fmt: skip
    assert checkpoint_pooling(checkpoint) == "mean"
    assert checkpoint_pooling(tiny_llama) == "last"
    with executor(checkpoint) as ex:
        (vector,) = embed(ex, prompts()[2:3], None)
    np.testing.assert_allclose(vector, hf_embedding(tiny_llama, prompts()[2], "mean"), atol=TOL, rtol=0)


@pytest.mark.parametrize(("tokens", "pooling", "words"), [
    ([], None, "input_token_ids is empty"),
    ([5, VOCAB_SIZE], None, f"token id {VOCAB_SIZE} is outside the vocabulary"),
    ([5] * 513, None, "exceeds the model's context of 512 tokens"),
    ([5], "cls", "pooling must be one of"),
])  # fmt: skip
def test_bad_embedding_requests_are_refused(tiny_llama: Path, tokens: list[int], pooling: str | None,
                                            words: str) -> None:  # fmt: skip
    with executor(tiny_llama) as ex:
        (responses,) = run_all(ex, [Request(input_token_ids=tokens, max_tokens=1,
                                            embedding_config=EmbeddingConfig(pooling))]).values()  # fmt: skip
    assert words in (responses[-1].error_msg or ""), responses


def test_an_embedding_cancelled_before_its_step_ends_cancelled(tiny_llama: Path) -> None:
    config = ExecutorConfig(backend="numpy", kv_cache_config=KvCacheConfig(max_tokens=4096))
    core = EngineCore.from_model(tiny_llama, config)
    core.add_requests([(1, Request(input_token_ids=[5, 6], max_tokens=1, embedding_config=EmbeddingConfig()))])
    assert core.has_work
    core.abort(1)
    (response,) = core.step().responses
    assert response.result is not None and response.result.embedding is None
    assert response.result.finish_reasons == [FinishReason.CANCELLED] and response.result.is_final
    assert not core.has_work
