"""Started in a process of its own by test_torch_backend_gpu.py, so that Triton's kernel
caches start empty: brings a TorchBackend up on the checkpoint given, then greedy-decodes
batches of 1 to 280 prompts of 2 to 300 tokens (prefill chunks, graph and eager decode
steps) and prints, as JSON, the Triton kernels compiled after start-up.

    python -m tests.gpu.compiles_after_start_up CHECKPOINT
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
from triton import knobs

from tests.worker.backends.greedy_driver import greedy_run
from worker.backends.torch_backend import TorchBackend

NUM_BLOCKS, BLOCK_SIZE = 8192, 16


def main(checkpoint: str) -> None:
    backend = TorchBackend.from_checkpoint(checkpoint, device="cuda", max_graph_batch=64, max_batch_size=300)
    backend.allocate_kv_cache(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    compiled: list[str] = []

    def record(*, fn: Any, **_: Any) -> None:
        compiled.append(fn.name)

    knobs.runtime.jit_post_compile_hook = record
    rng = np.random.default_rng(0)
    for batch in (1, 12, 40, 140, 280):
        prompts = {str(i): rng.integers(0, 4096, int(rng.integers(2, 300))).tolist() for i in range(batch)}
        greedy_run(backend, prompts, 3, seed=batch, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, chunk=64)
    print(json.dumps(compiled))


if __name__ == "__main__":
    main(sys.argv[1])
