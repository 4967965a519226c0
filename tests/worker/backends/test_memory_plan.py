"""The working memory kept out of the KV cache, and the KV cache sized from what is
left: each term grows with the limit that bounds it, the torch backend plans with an
injected free-memory figure, and an engine core whose configured batch cannot fit
refuses to start with one line saying what to lower."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from bench.model_shapes import LLAMA_8B  # noqa: E402
from worker.backends.memory_plan import FIXED_RESERVE_BYTES, WorkingMemory, plan_working_memory  # noqa: E402
from worker.backends.torch_backend import TorchBackend  # noqa: E402
from worker.executor import EngineCore, ExecutorConfig, KvCacheConfig  # noqa: E402
from worker.models.config import ModelConfig  # noqa: E402
from worker.models.loader import load_model  # noqa: E402

GIB = 1 << 30
CFG_8B = ModelConfig.from_hf(LLAMA_8B)


def plan_8b(max_num_tokens: int = 8192, max_batch_size: int = 1024, graph_batch: int = 1024) -> int:
    return plan_working_memory(CFG_8B, CFG_8B.vocab_size, 2, max_num_tokens=max_num_tokens,
                               max_batch_size=max_batch_size, graph_batch=graph_batch).total  # fmt: skip


def test_each_term_grows_with_its_own_limit() -> None:
    def plan(tokens: int, batch: int, graphs: int) -> WorkingMemory:
        return plan_working_memory(CFG_8B, CFG_8B.vocab_size, 2, max_num_tokens=tokens, max_batch_size=batch,
                                   graph_batch=graphs)  # fmt: skip

    base = plan(8192, 512, 512)
    assert plan(8192, 1024, 512).activations == base.activations  # not the batch
    assert plan(16384, 512, 512).activations == 2 * base.activations  # the token budget
    assert plan(8192, 1024, 512).sampling > base.sampling
    # Sampled rows never exceed the token budget, however large the batch.
    assert plan(256, 4096, 0).sampling == plan(256, 256, 0).sampling
    # One logits buffer for all graphs: the pool grows with the largest graph, linearly.
    assert plan(8192, 512, 1024).graphs == 2 * base.graphs
    assert plan(8192, 512, 0).graphs == 0
    assert base.fixed == FIXED_RESERVE_BYTES


def test_the_8b_shape_at_batch_1024_leaves_an_h100_room_for_the_batch() -> None:
    """An H100's 80 GB less the 8B shape's 16 GB of bf16 weights: at max_batch_size 1024
    the working memory leaves room for every sequence at 128 + 128 tokens; at 2048 it
    grows linearly (graphs and sampling), not with the sum of the graph buckets."""
    weights = 16 * 10**9
    free = 79 * GIB - weights
    kv_per_token = 2 * CFG_8B.num_layers * CFG_8B.num_kv_heads * CFG_8B.head_dim * 2
    working = plan_8b(max_batch_size=1024, graph_batch=1024)
    assert working < 8 * GIB
    assert int(0.9 * (free - working)) // kv_per_token >= 1024 * (128 + 128)
    assert plan_8b(max_batch_size=2048, graph_batch=2048) < 2 * working


def cpu_backend(directory: Path, **kw: object) -> TorchBackend:
    return TorchBackend(load_model(directory), device="cpu", **kw)  # type: ignore[arg-type]


def test_backend_plans_with_the_injected_free_memory(tiny_llama: Path) -> None:
    small = cpu_backend(tiny_llama, max_num_tokens=256, max_batch_size=64, free_memory=3 * GIB)
    assert small.free_memory_bytes() == 3 * GIB - small.working_memory().total
    bigger_batch = cpu_backend(tiny_llama, max_num_tokens=256, max_batch_size=256, free_memory=3 * GIB)
    assert bigger_batch.working_memory().activations == small.working_memory().activations
    assert bigger_batch.free_memory_bytes() < small.free_memory_bytes()
    assert small.working_memory().graphs == 0  # no CUDA graphs on the CPU
    spent = cpu_backend(tiny_llama, free_memory=FIXED_RESERVE_BYTES // 2)
    assert spent.free_memory_bytes() == 0


def test_engine_core_holds_the_configured_batch(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    backend = cpu_backend(tiny_llama, max_num_tokens=512, max_batch_size=1024,
                          free_memory=FIXED_RESERVE_BYTES + 320 * 2**20)  # fmt: skip
    config = ExecutorConfig(backend="torch", max_batch_size=1024, max_num_tokens=512,
                            kv_cache_config=KvCacheConfig(tokens_per_block=16, free_memory_fraction=0.5))  # fmt: skip
    left = backend.free_memory_bytes()
    with caplog.at_level(logging.INFO):
        core = EngineCore(backend, config)
    tokens = core.blocks.num_blocks * 16
    want = min(int(0.5 * left) // backend.kv_bytes_per_token(), 1024 * core.max_seq_len)
    assert tokens == want // 16 * 16
    assert tokens >= 1024 * (128 + 128)  # the configured batch at 128 / 128
    assert "max_batch_size=1024 sequences of up to" in caplog.text
    assert "working memory" in caplog.text


def test_engine_core_refuses_a_batch_the_cache_cannot_hold(tiny_llama: Path) -> None:
    backend = cpu_backend(tiny_llama, max_num_tokens=512, max_batch_size=1024, free_memory=FIXED_RESERVE_BYTES)
    per_token = backend.kv_bytes_per_token()
    # Room for 100 blocks of 16 tokens after the working memory, at the default fraction.
    room = backend.working_memory().total + int(1600 * per_token / 0.9) + per_token
    backend = cpu_backend(tiny_llama, max_num_tokens=512, max_batch_size=1024, free_memory=room)
    config = ExecutorConfig(backend="torch", max_batch_size=1024, max_num_tokens=512,
                            kv_cache_config=KvCacheConfig(tokens_per_block=16))  # fmt: skip
    with pytest.raises(ValueError, match=r"KV cache: .* less than one 16-token block") as e:
        EngineCore(backend, config)
    message = str(e.value)
    assert "\n" not in message
    assert "max_batch_size=1024" in message and "lower max_batch_size (to at most 100)" in message
    assert "max_num_tokens" in message
    # The same memory runs the batch it can hold.
    fits = ExecutorConfig(backend="torch", max_batch_size=100, max_num_tokens=512,
                          kv_cache_config=KvCacheConfig(tokens_per_block=16))  # fmt: skip
    assert EngineCore(backend, fits).blocks.num_blocks == 100
