"""bench/step_trace.py on iteration records as the worker's Redis stream holds them (every
field a string, streams read in any order)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from bench.step_trace import prompt_steps


def record(at: float, context: int, active: int, queued: int) -> SimpleNamespace:
    return SimpleNamespace(timestamp=str(at), num_context_requests=str(context), num_active_requests=str(active),
                           num_queued_requests=str(queued))  # fmt: skip


def test_the_prompt_steps_of_a_burst_and_what_the_engine_held_at_the_first() -> None:
    records = [
        record(100.030, 64, 128, 300),  # the second prompt step, read first
        record(99.990, 64, 64, 0),  # before the burst's first send: not counted
        record(100.010, 64, 64, 200),  # the first prompt step: 264 requests in by then
        record(100.060, 0, 512, 0),  # a step without prompt tokens
        record(100.050, 32, 512, 0),
    ]
    steps = prompt_steps(records, first_send_unix=100.0)
    assert (steps.steps, steps.first_held) == (3, 264)
    assert math.isclose(steps.last_ms, 50.0, abs_tol=1e-6)
    assert steps.cell() == "3 / 50 / 264"


def test_no_prompt_step_after_the_send_is_no_trace() -> None:
    steps = prompt_steps([record(99.0, 8, 8, 0)], first_send_unix=100.0)
    assert (steps.steps, steps.first_held) == (0, 0) and math.isnan(steps.last_ms)
