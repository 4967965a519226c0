"""The engine steps behind a burst, from the iteration stats the engine reports (in process:
the executor's; through the service: the worker's Redis stream): how many steps processed
prompt tokens, when the last of them ended, counted from the burst's first send, and how
many requests the engine held (running or queued) when the first of them ended. Set beside
the burst's TTFT p99, the end of the last prompt step tells an engine that admitted the
prompts later apart from a path that carried the first tokens back later; the requests held
at the first step tell a burst that reached the engine whole from one that trickled in
(its first steps then run part-full, and the prompts take more of them)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any


@dataclass(slots=True)
class PromptSteps:
    steps: int = 0  # steps that processed prompt tokens
    last_ms: float = math.nan  # the last of them ended this long after the first send
    first_held: int = 0  # requests running or queued in the engine when the first of them ended

    def cell(self) -> str:
        return f"{self.steps} / {self.last_ms:.0f} / {self.first_held}"


def unix_time(perf_counter_value: float) -> float:
    """A time.perf_counter() reading (CLOCK_MONOTONIC: one clock for every process of the
    host) as the unix time the engines' iteration stats carry."""
    return perf_counter_value + time.time() - time.perf_counter()


def prompt_steps(iterations: Iterable[Any], first_send_unix: float) -> PromptSteps:
    """`iterations`: IterationStats, or a stream's entries with the same fields as strings (of
    one engine: the held count is the first prompt step's engine's)."""
    steps = sorted((it for it in iterations
                    if int(it.num_context_requests) > 0 and float(it.timestamp) >= first_send_unix),
                   key=lambda it: float(it.timestamp))  # fmt: skip
    if not steps:
        return PromptSteps()
    first = steps[0]
    return PromptSteps(len(steps), (float(steps[-1].timestamp) - first_send_unix) * 1e3,
                       int(first.num_active_requests) + int(first.num_queued_requests))  # fmt: skip


def service_iterations(redis_url: str, since_unix: float) -> list[Any]:
    """Every worker's iteration stats written to Redis since `since_unix` (fields as strings)."""
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        entries = [entry for key in client.scan_iter(match="*:stats:iterations:*")
                   for entry in client.xrange(key, min=str(int(since_unix * 1000))) or ()]  # fmt: skip
        return [SimpleNamespace(**{str(k): v for k, v in (fields or {}).items()}) for _, fields in entries]
    finally:
        client.close()
