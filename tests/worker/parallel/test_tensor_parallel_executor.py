"""The executor over 2 and 4 tensor-parallel ranks (gloo, on the CPU): rank 0 runs the
core and sends each step to the other rank processes. Greedy tokens equal TP=1's and
transformers', generation logits within 1e-4 of TP=1's; beams, penalties, seeded
sampling, top-N, bad words, chunked context, a cancel and preemption give what TP=1
gives."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from tests.worker.executor.helpers import final_tokens, hf_greedy, run_all
from tests.worker.executor.test_decoding_backends import outputs, requests
from worker.executor import (
    CapacitySchedulerPolicy,
    Executor,
    ExecutorConfig,
    FinishReason,
    KvCacheConfig,
    OutputConfig,
    ParallelConfig,
    Request,
    Response,
    SamplingConfig,
    SchedulerConfig,
)
from worker.parallel.ranks import DistributedBackend


@contextmanager
def executor(model: Path, tp: int, **options: object) -> Iterator[Executor]:
    options.setdefault("kv_cache_config", KvCacheConfig(tokens_per_block=4, max_tokens=2048))
    config = ExecutorConfig(backend="torch", device="cpu", dtype="float32", max_beam_width=4,
                            parallel_config=ParallelConfig(tp), **options)  # type: ignore[arg-type]  # fmt: skip
    ex = Executor.from_model(model, config)
    try:
        assert isinstance(ex.core.backend, DistributedBackend) == (tp > 1)
        yield ex
    finally:
        ex.shutdown()  # and the ranks with it: the next test's ranks form a group of their own


def _prompts() -> list[list[int]]:
    return [list(range(7, 30)), [5, 9, 200, 31], list(range(100, 140, 3))]


@pytest.mark.parametrize(
    ("name", "tp"),
    [
        ("llama_gqa", 2),
        ("qwen2_mqa", 2),
        # One KV head on 4 ranks. Every family's shard at 2 and 4 ranks: test_sharded_backend.py.
        pytest.param("qwen2_mqa", 4, marks=pytest.mark.slow),
    ],
)
def test_greedy_equals_tp1_and_transformers(name: str, tp: int, tiny_checkpoints: dict[str, Path]) -> None:
    """Prompts longer than max_num_tokens go in chunks beside the others' generation."""
    model = tiny_checkpoints[name]

    def run(size: int) -> tuple[list[list[int]], list[np.ndarray]]:
        reqs = [Request(input_token_ids=p, max_tokens=8, end_id=-1, sampling_config=SamplingConfig(temperature=0.0),
                        output_config=OutputConfig(return_generation_logits=i == 0))
                for i, p in enumerate(_prompts())]  # fmt: skip
        with executor(model, size, max_num_tokens=16) as ex:
            got = list(run_all(ex, reqs).values())
        logits = got[0][-1].result.generation_logits  # type: ignore[union-attr]
        return [final_tokens(r) for r in got], [np.asarray(logits)]

    tokens, logits = run(tp)
    want_tokens, want_logits = run(1)
    assert tokens == want_tokens
    np.testing.assert_allclose(logits[0], want_logits[0], atol=1e-4, rtol=0)
    assert tokens == [hf_greedy(model, p, 8) for p in _prompts()]


def test_decoding_features_cancels_and_preemption_equal_tp1(tiny_llama: Path) -> None:
    """Every decoding feature, plus requests that outgrow a small KV pool (the newest
    are preempted and recomputed), and one cancelled while it runs."""
    long = [Request(input_token_ids=[60 + i, 61, 62, 63, 64, 65], max_tokens=30, end_id=-1,
                    sampling_config=SamplingConfig(temperature=0.0)) for i in range(4)]  # fmt: skip
    policy = SchedulerConfig(CapacitySchedulerPolicy.MAX_UTILIZATION)

    def run(tp: int) -> tuple[list[object], FinishReason]:
        with executor(tiny_llama, tp, kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=96),
                      scheduler_config=policy) as ex:  # fmt: skip
            doomed = Request(input_token_ids=[3, 4, 5], max_tokens=80, end_id=-1, streaming=True)
            ids = ex.enqueue_requests([doomed, *requests(), *long])
            got: dict[int, list[Response]] = {i: [] for i in ids}
            pending = set(ids)
            while pending:
                for r in ex.await_responses(timeout=60):
                    if r.request_id == ids[0] and not got[ids[0]]:
                        ex.cancel_request(ids[0])
                    got[r.request_id].append(r)
                    if r.has_error or (r.result is not None and r.result.is_final):
                        pending.discard(r.request_id)
            final = got[ids[0]][-1].result
            assert final is not None
            assert ex.core.scheduler.num_preemptions > 0
            return [outputs(got[i]) for i in ids[1:]], final.finish_reasons[0]

    got, cancelled = run(2)
    want, _ = run(1)
    assert got == want
    assert cancelled == FinishReason.CANCELLED
