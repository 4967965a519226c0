"""max_batch_size 1024 on CUDA, on the Llama-3.1-8B shape cut to 4 layers (its width,
heads and 128k vocabulary; random bf16 weights): the KV cache the engine core sizes
holds every sequence of the batch at 128 + 128 tokens, the CUDA graphs up to 1024
fit in what the working-memory plan set aside, and 1024 requests run at once.

Prints the plan, the capture time and the peak memory (make test-gpu -s)."""

from __future__ import annotations

import time

import pytest
import torch

from bench.model_shapes import LLAMA_8B
from bench.random_weights import random_weights
from worker.backends.torch_backend import TorchBackend
from worker.executor import EngineCore, Executor, ExecutorConfig, KvCacheConfig, Request
from worker.models.config import ModelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BATCH, PROMPT, OUTPUT, BLOCK = 1024, 128, 128, 32
GIB = 1 << 30


def test_batch_1024_on_the_8b_shape_cut_to_4_layers() -> None:
    cfg = ModelConfig.from_hf({**LLAMA_8B, "num_hidden_layers": 4})
    device = torch.device("cuda")
    weights = random_weights(cfg, device, torch.bfloat16)
    backend = TorchBackend(cfg, device, weights=weights, max_num_tokens=8192, max_model_len=4096,
                           max_graph_batch=BATCH, max_batch_size=BATCH)  # fmt: skip
    working = backend.working_memory()
    kv = KvCacheConfig(tokens_per_block=BLOCK, enable_block_reuse=False)
    config = ExecutorConfig(max_batch_size=BATCH, max_num_tokens=8192, kv_cache_config=kv)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what making the weights left cached is nobody's
    weights_bytes = torch.cuda.memory_allocated()
    before = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    core = EngineCore(backend, config)  # sizes and allocates the KV cache, then captures every decode graph
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the warm-ups' freed activations, outside the graphs' pool
    kv_tokens = core.blocks.num_blocks * BLOCK
    print(f"\nworking memory {working.describe()}; KV cache {kv_tokens} tokens ({kv_tokens // BATCH} per sequence)")
    assert kv_tokens >= BATCH * (PROMPT + OUTPUT)
    kv_bytes = sum(t.numel() * t.element_size() for t in backend.ops.k_cache + backend.ops.v_cache)
    base = weights_bytes + kv_bytes
    captured = torch.cuda.memory_reserved() - before - kv_bytes
    assert backend._graphs is not None
    print(f"{len(backend._graphs.buckets)} graphs to {BATCH} captured in {time.perf_counter() - t0:.1f} s with the "
          f"KV cache, {captured / GIB:.2f} GiB (planned {working.graphs / GIB:.2f} GiB)")  # fmt: skip
    assert captured <= working.graphs + working.fixed  # the fixed reserve: allocator rounding and slack

    torch.cuda.reset_peak_memory_stats()
    rng = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, cfg.vocab_size - 10, (BATCH, PROMPT), generator=rng).tolist()
    with Executor(core) as executor:
        ids = executor.enqueue_requests([Request(input_token_ids=p, max_tokens=OUTPUT, end_id=-1) for p in prompts])
        pending, tokens = set(ids), 0
        while pending:
            for r in executor.await_responses(timeout=120.0):
                assert not r.has_error, r.error_msg
                if r.result is not None and r.result.is_final:
                    tokens += len(r.result.output_token_ids[0])
                    pending.discard(r.request_id)
        stats = executor.get_latest_iteration_stats()
    peak = torch.cuda.max_memory_reserved() - base
    widest = max(s.num_generation_requests for s in stats)
    print(f"{BATCH} requests: widest decode step {widest}; peak beyond weights and KV cache, graphs included, "
          f"{peak / GIB:.2f} GiB (planned {working.total / GIB:.2f} GiB)")  # fmt: skip
    assert tokens == BATCH * OUTPUT
    assert widest == BATCH
    assert peak <= working.total
