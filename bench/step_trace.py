"""The engine steps behind a burst, from the iteration stats the engine reports (in process:
the executor's; through the service: the worker's Redis stream): how many steps processed
prompt tokens, and when the last of them ended, counted from the burst's first send. Set
beside the burst's TTFT p99, it tells an engine that admitted the prompts later apart from a
path that carried the first tokens back later."""

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


def unix_time(perf_counter_value: float) -> float:
    """A time.perf_counter() reading (CLOCK_MONOTONIC: one clock for every process of the
    host) as the unix time the engines' iteration stats carry."""
    return perf_counter_value + time.time() - time.perf_counter()


def prompt_steps(iterations: Iterable[Any], first_send_unix: float) -> PromptSteps:
    """`iterations`: IterationStats, or a stream's entries with the same fields as strings."""
    ends = [float(it.timestamp) for it in iterations
            if int(it.num_context_requests) > 0 and float(it.timestamp) >= first_send_unix]  # fmt: skip
    return PromptSteps(len(ends), (max(ends) - first_send_unix) * 1e3) if ends else PromptSteps()


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
