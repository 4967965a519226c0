"""The executor over 2 and 4 tensor-parallel ranks (gloo, on the CPU): rank 0 runs the
core and sends each step to the other rank processes. Greedy tokens equal TP=1's and
transformers', generation logits within 1e-4 of TP=1's. (Beams, penalties, seeded
sampling, top-N, bad words, chunked context, a cancel and preemption under TP=2:
test_pipeline_parallel_executor.py, beside the pipeline's.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.worker.executor.helpers import final_tokens, hf_greedy, run_all
from tests.worker.parallel.executors import parallel_executor as executor
from worker.executor import (
    KvCacheConfig,
    OutputConfig,
    Request,
    SamplingConfig,
)


def _prompts() -> list[list[int]]:
    return [list(range(7, 30)), [5, 9, 200, 31], list(range(100, 140, 3))]


@pytest.mark.parametrize(
    ("name", "tp"),
    [
        ("llama_gqa", 2),
        ("qwen2_mqa", 2),
        # One KV head on 4 ranks. Every family's shard at 2 and 4 ranks: test_sharded_backend.py.
        pytest.param("qwen2_mqa", 4, marks=pytest.mark.slow),
    ],
)
def test_greedy_equals_tp1_and_transformers(name: str, tp: int, tiny_checkpoints: dict[str, Path]) -> None:
    """Prompts longer than max_num_tokens go in chunks beside the others' generation."""
    model = tiny_checkpoints[name]

    def run(size: int) -> tuple[list[list[int]], list[np.ndarray]]:
        reqs = [Request(input_token_ids=p, max_tokens=8, end_id=-1, sampling_config=SamplingConfig(temperature=0.0),
                        output_config=OutputConfig(return_generation_logits=i == 0))
                for i, p in enumerate(_prompts())]  # fmt: skip
        with executor(model, size, max_num_tokens=16) as ex:
            got = list(run_all(ex, reqs).values())
        logits = got[0][-1].result.generation_logits  # type: ignore[union-attr]
        return [final_tokens(r) for r in got], [np.asarray(logits)]

    tokens, logits = run(tp)
    want_tokens, want_logits = run(1)
    assert tokens == want_tokens
    np.testing.assert_allclose(logits[0], want_logits[0], atol=1e-4, rtol=0)
    assert tokens == [hf_greedy(model, p, 8) for p in _prompts()]


@pytest.mark.parametrize(
    "options",
    [{"quantization": "int4"}, {"kv_cache_config": KvCacheConfig(tokens_per_block=4, max_tokens=2048, dtype="fp8")}],
    ids=["int4-on-load", "fp8-kv-cache"],
)
def test_every_rank_quantizes_as_one_process_does(options: dict[str, object],
                                                  tiny_checkpoints: dict[str, Path]) -> None:  # fmt: skip
    """Quantization on load and an FP8 KV cache reach every rank, not rank 0 alone: TP=2's
    logits equal TP=1's (int4 groups lie along a row, inside a rank's cut; e4m3 rounds each
    K and V value alone), while they move the logits well beyond that tolerance. Rank 0's
    backend names the quantization, as one process's does (the worker's Ready says it)."""
    model = tiny_checkpoints["llama_gqa"]

    def logits(size: int, **opts: Any) -> np.ndarray:
        req = Request(input_token_ids=_prompts()[0], max_tokens=6, end_id=-1,
                      sampling_config=SamplingConfig(temperature=0.0),
                      output_config=OutputConfig(return_generation_logits=True))  # fmt: skip
        with executor(model, size, **opts) as ex:
            [responses] = run_all(ex, [req]).values()
            # What the worker's Ready names, over several ranks as in one process.
            assert ex.core.backend.quantization == ("int4 (quantized on load, int4 RTN)"  # type: ignore[attr-defined]
                                                    if opts.get("quantization") else None)  # fmt: skip
        return np.asarray(responses[-1].result.generation_logits)  # type: ignore[union-attr]

    one = logits(1, **options)
    np.testing.assert_allclose(logits(2, **options), one, atol=1e-4, rtol=0)
    assert np.abs(one - logits(1)).max() > 1e-3


def test_ranks_plan_working_memory_for_the_whole_batch(tiny_checkpoints: dict[str, Path]) -> None:
    """Graphs stop at 512 sequences under TP, but a step may sample max_batch_size rows:
    the ranks plan their working memory (logits, sampler) for those, as one process does."""
    with executor(tiny_checkpoints["llama_gqa"], 2, max_batch_size=1024,
                  kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=8192)) as ex:  # fmt: skip
        inner = ex.core.backend.inner  # type: ignore[attr-defined]
        assert inner.max_batch_size == 1024

