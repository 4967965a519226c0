"""A run gpu_bench saved as JSON, read back: its roofline recomputed from the ceilings it
measured (bandwidth, GEMM rate) with today's roofline model, so old runs and new compare."""

from __future__ import annotations

from typing import Any

from bench.model_shapes import hf_config
from bench.roofline import Roofline, roofline_of
from worker.models.config import ModelConfig


def saved_roofline(saved: dict[str, Any]) -> Roofline:
    shape = saved.get("model_shape", "8b")
    cfg = ModelConfig.from_hf(hf_config(shape))
    dtype_bytes = 4 if saved.get("dtype") == "float32" else 2  # runs saved before it was recorded ran bf16
    return roofline_of(cfg, saved.get("quantization"), dtype_bytes, saved["bandwidth_TBps"] * 1e12,
                       saved["gemm_TFLOPps"] * 1e12, saved.get("pipeline_parallel_size", 1),
                       saved.get("kv_cache_dtype"), saved.get("expert_dtype", "bf16"))  # fmt: skip


def saved_roofline_tok_s(roof: Roofline, saved: dict[str, Any], workload: str, requests: int,
                         extra: dict[str, Any]) -> float:  # fmt: skip
    """A saved row's roofline: its workload ('128/128') under the run's scheduler policy."""
    prompt, output = (int(x) for x in workload.split("/"))
    # Runs saved before kv_tokens was recorded: the H100's 13773 blocks of 32 tokens.
    kv_tokens = int(extra.get("kv_tokens", 13773 * 32))
    max_batch = int(extra.get("max_batch", 512))  # runs saved before it was recorded ran at 512
    return roof.for_schedule(prompt, output, requests, max_batch, kv_tokens,
                             saved.get("scheduler_policy", "guaranteed_no_evict"))  # fmt: skip
