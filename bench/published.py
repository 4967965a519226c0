"""TensorRT-LLM's published offline throughput, the figures gpu_bench's rows are compared
with: output tokens/s of all requests enqueued at once, by model shape, quantization,
tensor-parallel size and workload (prompt/output tokens), on H200s."""

from __future__ import annotations

# (model shape, quantization, tensor-parallel size) -> workload -> output tok/s
PUBLISHED_TOK_S: dict[tuple[str, str, int], dict[str, int]] = {
    # TensorRT-LLM performance overview v1.0, H200: Llama 3.1 8B FP8, one GPU.
    ("8b", "fp8", 1): {"128/128": 27_911, "128/2048": 26_221, "2048/128": 3_538, "1000/1000": 17_744,
                       "2048/2048": 12_194},
    # TensorRT-LLM performance overview v0.20, H200: Llama 3.3 70B FP8, TP=2.
    ("70b", "fp8", 2): {"128/128": 6_428, "1000/1000": 5_120, "128/2048": 8_464},
}  # fmt: skip
PUBLISHED_GPU = "H200"


def published_rows(model_shape: str, quantization: str | None, tensor_parallel_size: int) -> dict[str, int]:
    """The published rows for this setup (empty where TensorRT-LLM published none)."""
    return PUBLISHED_TOK_S.get((model_shape, quantization or "", tensor_parallel_size), {})


def published_tok_s(gpu: str, model_shape: str, quantization: str | None, tensor_parallel_size: int,
                    workload: str) -> int | None:  # fmt: skip
    """The published figure a row compares with: the same setup and workload on the GPU the
    figures were measured on (`gpu` as torch names it), else None."""
    if PUBLISHED_GPU not in gpu:
        return None
    return published_rows(model_shape, quantization, tensor_parallel_size).get(workload)
