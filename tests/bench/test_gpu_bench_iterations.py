"""The GPU bench's iteration summary: what a step costs, from the time between results,
apart from the overlapping launch-to-results latencies (no GPU needed)."""

from __future__ import annotations

import math

import pytest

from bench.runner import iteration_summary
from worker.executor import IterationStats


def iteration(i: int, t: float, latency_ms: float, context: int, generation: int) -> IterationStats:
    return IterationStats(timestamp=t, iter=i, iter_latency_ms=latency_ms, num_active_requests=context + generation,
                          num_queued_requests=0, num_context_requests=context, num_generation_requests=generation,
                          num_scheduled_tokens=0, max_num_blocks=64, free_num_blocks=0, used_num_blocks=64,
                          reused_blocks=0)  # fmt: skip


def test_steps_are_the_time_between_results_by_kind() -> None:
    # Two prefill chunks of 100 ms, then decode steps of 12 ms whose latencies (launch to results)
    # span two steps each, as pipelined iterations do; one 13 ms decode step among them.
    stats = [iteration(1, 10.0, 100.0, 8, 0), iteration(2, 10.100, 190.0, 8, 0), iteration(3, 10.112, 110.0, 0, 16),
             iteration(4, 10.124, 24.0, 0, 16), iteration(5, 10.137, 25.0, 0, 16),
             iteration(6, 10.149, 24.0, 0, 16)]  # fmt: skip
    summary = iteration_summary(stats)
    assert summary["ctx_iters"] == 2 and summary["gen_iters"] == 4
    assert summary["ctx_step_ms"] == pytest.approx(100.0)  # the first iteration has no step before it to time from
    assert summary["gen_step_ms"] == pytest.approx(12.0)  # the median of 12, 12, 13, 12
    assert summary["gen_ms"] == pytest.approx(45.75)  # the latencies, overlapping, say more than a step costs
    assert summary["ctx_ms"] == pytest.approx(145.0)


def test_a_run_of_one_kind_leaves_the_other_unmeasured() -> None:
    summary = iteration_summary([iteration(1, 5.0, 20.0, 0, 4), iteration(2, 5.010, 20.0, 0, 4)])
    assert summary["gen_step_ms"] == pytest.approx(10.0)
    assert summary["ctx_iters"] == 0 and math.isnan(summary["ctx_step_ms"])
