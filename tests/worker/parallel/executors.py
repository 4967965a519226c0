"""The executor over tp x pp ranks on the CPU (gloo), as the parallel tests build it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from worker.executor import Executor, ExecutorConfig, KvCacheConfig, ParallelConfig
from worker.parallel.ranks import DistributedBackend


@contextmanager
def parallel_executor(model: Path, tp: int, pp: int = 1, micro_batches: int = 0, expert_parallel: bool = False,
                      **options: object) -> Iterator[Executor]:  # fmt: skip
    """float32 on the CPU, a small KV cache of 4-token blocks and beams up to 4 unless
    `options` (ExecutorConfig fields) say otherwise; `expert_parallel`: MoE experts whole per rank."""
    options.setdefault("kv_cache_config", KvCacheConfig(tokens_per_block=4, max_tokens=2048))
    options.setdefault("max_beam_width", 4)
    config = ExecutorConfig(backend="torch", device="cpu", dtype="float32",
                            parallel_config=ParallelConfig(tp, pp, micro_batches, expert_parallel),
                            **options)  # type: ignore[arg-type]  # fmt: skip
    ex = Executor.from_model(model, config)
    try:
        assert isinstance(ex.core.backend, DistributedBackend) == (tp * pp > 1)
        yield ex
    finally:
        ex.shutdown()  # and the ranks with it: the next test's ranks form a group of their own
