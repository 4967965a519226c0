"""LoRA adapters over several GPUs: a batch mixing two adapters of different ranks and
targets with the base model gives one GPU's greedy tokens under tensor parallelism
(NCCL; the Triton LoRA kernel and the all-reduce after it captured in the decode CUDA
graphs) and pipeline parallelism, in float32 exactly and with logits within 1e-3, and
in bf16 up to a near tie (see test_parallel_gpu.py: the row-parallel halves,
each with its partial LoRA delta, are rounded before they are summed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.gpu.test_lora_gpu import write_adapter
from tests.gpu.test_parallel_gpu import assert_same_up_to_a_near_tie, final_results
from worker.executor import (
    Executor,
    ExecutorConfig,
    KvCacheConfig,
    LoraConfig,
    OutputConfig,
    ParallelConfig,
    PeftCacheConfig,
    Request,
    SamplingConfig,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
NAMES = ["a", "b", None, "a", "b", None, "b"]  # 7 rows: the graph bucket of 8 pads one
PROMPTS = [[7 + (5 * i + 3 * j) % 300 for j in range(9 + 11 * i)] for i in range(len(NAMES))]
NEW_TOKENS = 24


def _adapters(model: Path, root: Path) -> dict[str, str]:
    return {"a": write_adapter(model, root / "a", 4, ["q_proj", "v_proj", "down_proj"], 1),
            "b": write_adapter(model, root / "b", 8, ["k_proj", "o_proj", "gate_proj", "up_proj"], 2)}  # fmt: skip


def _run(model: Path, adapters: dict[str, str], tp: int, pp: int,
         dtype: str) -> tuple[list[list[int]], list[np.ndarray]]:  # fmt: skip
    """Greedy tokens and generation logits of every prompt under its adapter. max_num_tokens
    64 puts the long prompts in chunks beside the others' generation."""
    config = ExecutorConfig(backend="torch", dtype=dtype, max_num_tokens=64, parallel_config=ParallelConfig(tp, pp),
                            kv_cache_config=KvCacheConfig(max_tokens=4096), lora_adapters=adapters,
                            peft_cache_config=PeftCacheConfig(max_device_adapters=2, max_rank=8))  # fmt: skip
    ex = Executor.from_model(model, config)
    try:
        greedy, logits = SamplingConfig(temperature=0.0), OutputConfig(return_generation_logits=True)
        ids = ex.enqueue_requests([
            Request(input_token_ids=p, max_tokens=NEW_TOKENS, end_id=-1, sampling_config=greedy, output_config=logits,
                    lora_config=None if n is None else LoraConfig(n))
            for p, n in zip(PROMPTS, NAMES, strict=True)
        ])  # fmt: skip
        finals = final_results(ex, ids)
        return [finals[i].output_token_ids[0] for i in ids], [np.asarray(finals[i].generation_logits)[0] for i in ids]
    finally:
        ex.shutdown()  # and the ranks with it


@pytest.mark.parametrize(
    ("name", "tp", "pp"),
    [
        ("llama_gqa", 2, 1),
        ("qwen2_mqa", 2, 1),  # one KV head, copied on both ranks
        ("llama_gqa", 1, 2),
        pytest.param("qwen2_mqa", 2, 2, marks=pytest.mark.skipif(torch.cuda.device_count() < 4,
                                                                 reason="needs four CUDA devices")),
    ],
)  # fmt: skip
def test_float32_mixed_adapters_equal_one_gpu(name: str, tp: int, pp: int, tmp_path: Path) -> None:
    model = make_checkpoint(name, tmp_path / name)
    adapters = _adapters(model, tmp_path)
    tokens, logits = _run(model, adapters, tp, pp, "float32")
    want_tokens, want_logits = _run(model, adapters, 1, 1, "float32")
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)


def test_bf16_tp2_mixed_adapters_equal_one_gpu_up_to_a_near_tie(tmp_path: Path) -> None:
    model = make_checkpoint("llama_gqa", tmp_path / "llama_gqa")
    adapters = _adapters(model, tmp_path)
    tokens, logits = _run(model, adapters, 2, 1, "bfloat16")
    want_tokens, want_logits = _run(model, adapters, 1, 1, "bfloat16")
    assert_same_up_to_a_near_tie(tokens, want_tokens, logits, want_logits)
