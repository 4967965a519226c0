"""The requests the offline benches send: random prompts of a fixed length, and which
workloads (prompt/output lengths) a run takes."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Sequence
from typing import TypeVar

import numpy as np

from bench.published import published_rows

W = TypeVar("W", bound=tuple[int, ...])


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab - 10, (n, length)).tolist()


def select_workloads(
    workloads: Sequence[W], args: argparse.Namespace, default: Collection[str] | None = None
) -> list[W]:
    """Of `workloads` (each `(prompt, output, ...)`), those `--workloads` names ('128/128,...'),
    or with `--published` those TensorRT-LLM published for the run's model shape,
    quantization and tensor-parallel size (narrowed by `--workloads` where both are given);
    with neither, `default` (every one where None)."""
    keep = set(args.workloads.split(",")) if args.workloads else None
    if args.published:
        tensor_parallel = args.tensor_parallel_size if args.pipeline_parallel_size == 1 else 0
        rows = published_rows(args.model_shape, args.quantization, tensor_parallel)
        if not rows:
            raise ValueError(f"--published: TensorRT-LLM published no rows for model shape {args.model_shape}, "
                             f"quantization {args.quantization}, tensor-parallel size {tensor_parallel}")  # fmt: skip
        keep = set(rows) if keep is None else keep & set(rows)
    elif keep is None and default is not None:
        keep = set(default)
    return [w for w in workloads if keep is None or f"{w[0]}/{w[1]}" in keep]
