"""Expert parallelism on CUDA: each rank's fused expert kernel over its own experts (bf16
and FP8), summed over the ranks, computes the whole layer; over two GPUs (NCCL, the
all-reduce captured in the decode CUDA graphs) greedy tokens equal one GPU's, in float32
exactly (the expert loop) and in bf16 up to a near tie (the fused kernel; see
test_parallel_gpu.py for the bound)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.checkpoints import make_checkpoint
from tests.gpu.test_parallel_gpu import assert_same_up_to_a_near_tie, final_results
from worker.backends.torch_backend import TorchBackend
from worker.backends.torch_moe import experts_out, route
from worker.executor import (
    Executor,
    ExecutorConfig,
    KvCacheConfig,
    OutputConfig,
    ParallelConfig,
    Request,
    SamplingConfig,
)
from worker.models.loader import load_model
from worker.parallel.group import TensorGroup, World

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FAMILIES = ["mixtral_top2_window", "qwen3_moe_top4_dense_layer"]
PROMPTS = [list(range(7, 40)), [5, 9, 200, 31], list(range(100, 300, 7)), [11, 12, 13]]
NEW_TOKENS = 24


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("name", FAMILIES)
def test_the_ranks_fused_experts_sum_to_the_whole_layer(name: str, quantization: str | None,
                                                        tmp_path: Path) -> None:  # fmt: skip
    """Both ranks' backends built on one GPU (building runs no collective). The same
    routing; each rank's output rounds to bf16 before the sum: relative L2 within 1e-2."""
    model = load_model(make_checkpoint(name, tmp_path / name))
    cuda = torch.device("cuda")

    def backend(world: World | None) -> TorchBackend:
        return TorchBackend(model, device="cuda", dtype="bfloat16", max_model_len=64, use_cuda_graphs=False,
                            quantization=quantization, world=world)  # fmt: skip

    whole = backend(None)
    ranks = [backend(World(r, 2, 1, cuda, TensorGroup(r, 2, cuda), expert_parallel=True)) for r in range(2)]
    cfg = whole.config
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(cuda, torch.bfloat16)
    for i, layer in enumerate(whole.model.layers):
        if layer.experts is None:
            continue
        chosen, weights = route(F.linear(x, layer.experts.router, layer.experts.router_bias), cfg)
        want = experts_out(x, layer.experts, chosen, weights, cfg.expert_act).float()
        parts = [r.model.layers[i].experts for r in ranks]
        assert all(p.fused is not None and p.fused.num_experts == cfg.num_experts // 2 for p in parts)
        got = sum(experts_out(x, p, chosen, weights, cfg.expert_act).float() for p in parts)
        assert float((got - want).norm() / want.norm()) < 1e-2


def _run(model: Path, tp: int, dtype: str) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy tokens of every prompt and every prompt's generation logits; max_num_tokens
    64 puts the long prompts in chunks beside generation."""
    config = ExecutorConfig(backend="torch", dtype=dtype, max_num_tokens=64,
                            parallel_config=ParallelConfig(tp, expert_parallel=tp > 1),
                            kv_cache_config=KvCacheConfig(max_tokens=4096))  # fmt: skip
    ex = Executor.from_model(model, config)
    try:
        greedy = SamplingConfig(temperature=0.0)
        ids = ex.enqueue_requests([
            Request(input_token_ids=p, max_tokens=NEW_TOKENS, end_id=-1, sampling_config=greedy,
                    output_config=OutputConfig(return_generation_logits=True))
            for p in PROMPTS
        ])  # fmt: skip
        finals = final_results(ex, ids)
        return [finals[i].output_token_ids[0] for i in ids], [np.asarray(finals[i].generation_logits)[0] for i in ids]
    finally:
        ex.shutdown()  # and the ranks with it


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("name", FAMILIES)
def test_float32_expert_parallel_equals_one_gpu(name: str, tmp_path: Path) -> None:
    model = make_checkpoint(name, tmp_path / name)
    tokens, logits = _run(model, 2, "float32")
    want_tokens, want_logits = _run(model, 1, "float32")
    assert tokens == want_tokens
    np.testing.assert_allclose(logits[0], want_logits[0], atol=1e-3, rtol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_expert_parallel_greedy_equals_one_gpu_up_to_a_near_tie(name: str, tmp_path: Path) -> None:
    model = make_checkpoint(name, tmp_path / name)
    tokens, logits = _run(model, 2, "bfloat16")
    want_tokens, want_logits = _run(model, 1, "bfloat16")
    assert_same_up_to_a_near_tie(tokens, want_tokens, logits, want_logits)
