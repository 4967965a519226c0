"""Deterministic mode on CUDA: seeded requests draw the same tokens alone, in two
batches and all together (cuBLAS in fixed row tiles, no batch-dependent split-KV), and
a continuation (a migrated stream) generates exactly the rest of an undisturbed run."""

from __future__ import annotations

import dataclasses
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.worker.backends.test_deterministic import assert_same_tokens_after_preemption, tokens_in_batches
from tests.worker.executor.test_continuation import continued_at_cuts, requests
from worker.executor import Executor, ExecutorConfig, KvCacheConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seeded_requests_sample_the_same_tokens_whatever_the_batch(dtype: str, tmp_path: Path) -> None:
    checkpoint = make_checkpoint("llama_gqa", tmp_path / "llama")
    config = ExecutorConfig(backend="torch", device="cuda", dtype=dtype, deterministic=True,
                            kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=4096))  # fmt: skip
    together = tokens_in_batches(checkpoint, config, 32)
    assert all(len(t) == 12 for t in together)
    assert tokens_in_batches(checkpoint, config, 16) == together
    assert tokens_in_batches(checkpoint, config, 1) == together
    # 16 tokens a step: prompts cut into chunks, decode tokens sharing steps with chunks.
    assert tokens_in_batches(checkpoint, dataclasses.replace(config, max_num_tokens=16), 32) == together
    assert_same_tokens_after_preemption(checkpoint, config)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_continuations_generate_the_rest_of_the_undisturbed_output(dtype: str, tmp_path: Path) -> None:
    checkpoint = make_checkpoint("llama_gqa", tmp_path / "llama")
    config = ExecutorConfig(backend="torch", device="cuda", dtype=dtype, deterministic=True, max_num_tokens=8,
                            kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=4096))  # fmt: skip
    named = {name: r for name, r in requests().items() if name != "guided" or find_spec("xgrammar") is not None}
    with Executor.from_model(checkpoint, config) as ex:
        outcomes = continued_at_cuts(ex, named)
    assert outcomes
    for label, (want, got) in outcomes.items():
        assert got == want, label
