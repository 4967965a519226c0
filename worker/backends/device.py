"""Which backend runs a model: `auto` takes torch on CUDA when a GPU is there, else numpy.

Kept apart from the backends so that choosing never imports torch where it is not
installed, and so the worker can say in its logs and stats what it picked.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from worker.backends.base import Backend

if TYPE_CHECKING:
    from worker.executor.types import ParallelConfig

BACKEND_CHOICES = ("auto", "numpy", "torch")


def cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def resolve_backend(choice: str) -> str:
    """'auto' | 'numpy' | 'torch' -> 'numpy' or 'torch'."""
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_CHOICES)}, got {choice!r}")
    if choice == "auto":
        return "torch" if cuda_available() else "numpy"
    return choice


def create_backend(
    model: Any,
    choice: str = "auto",
    device: str | None = None,
    dtype: str | None = None,
    max_num_tokens: int | None = None,
    max_batch_size: int | None = None,
    parallel: ParallelConfig | None = None,
    kv_cache_dtype: str | None = None,
    deterministic: bool = False,
) -> Backend:
    """Build the backend for a LoadedModel. `device` / `dtype` apply to torch only
    (default: cuda and bfloat16 when there is a GPU, else cpu and float32); so do the
    executor's limits, which size the activation reserve and the CUDA-graph buckets.
    A `parallel` config over several ranks starts them (torch only: worker/parallel).
    `deterministic`: a request's logits do not depend on its batch-mates (one rank only)."""
    kind = resolve_backend(choice)
    if parallel is not None and parallel.expert_parallel:  # refused on one rank too: the flag would mean nothing
        from worker.parallel import expert_parallel

        expert_parallel.validate(model.config, parallel.tensor_parallel_size)
    if parallel is not None and parallel.world_size > 1:
        if choice == "numpy":
            raise ValueError("tensor or pipeline parallelism needs the torch backend")
        if deterministic:
            raise ValueError("deterministic mode runs on one device, not with tensor or pipeline parallelism")
        from worker.parallel.ranks import start_ranks

        batch = max_batch_size or 512
        return start_ranks(model, device, dtype, max_num_tokens or 8192, min(batch, 512), batch, parallel,
                           kv_cache_dtype)  # fmt: skip
    if kind == "numpy":
        if device not in (None, "cpu"):
            raise ValueError(f"the numpy backend runs on the CPU only, got device {device!r}")
        if kv_cache_dtype is not None:
            raise ValueError(f"a {kv_cache_dtype} KV cache needs the torch backend")
        from worker.backends.numpy_backend import NumpyBackend

        return NumpyBackend(model, deterministic)
    from worker.backends.torch_backend import TorchBackend

    # Generation steps of every batch size run as CUDA graphs: the graphs share one
    # logits buffer, so their memory grows with the largest batch, not the sum of buckets.
    return TorchBackend(
        model,
        device=device,
        dtype=dtype,
        max_num_tokens=max_num_tokens or 8192,
        max_graph_batch=max_batch_size or 512,
        max_batch_size=max_batch_size or 512,
        kv_cache_dtype=kv_cache_dtype,
        deterministic=deterministic,
    )


def describe(backend: Backend) -> dict[str, str]:
    """What runs the model, for logs and stats: backend name, device, dtype, GPU model."""
    info = {"backend": backend.name}
    device = getattr(backend, "device", None)
    if device is not None:
        info["device"] = str(device)
        info["dtype"] = str(getattr(backend, "dtype", "")).removeprefix("torch.")
        if getattr(device, "type", None) == "cuda":
            import torch

            info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["device"] = "cpu"
        info["dtype"] = "float32"
    return info
