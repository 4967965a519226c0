"""Requests through an Executor, timed: all at once until the last ends (offline), one alone
(TTFT and TPOT); the executor configuration they run under, and what its iterations say."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from bench import log


def run_executor_offline(executor: Any, prompts: list[list[int]], output: int) -> tuple[float, int]:
    from worker.executor import Request

    return run_requests_offline(executor, [Request(input_token_ids=p, max_tokens=output, end_id=-1) for p in prompts])


def run_requests_offline(executor: Any, requests: list[Any]) -> tuple[float, int]:
    """(seconds, output tokens) for `requests` enqueued at once, until the last one ends."""
    t0 = time.perf_counter()
    pending, tokens = set(executor.enqueue_requests(requests)), 0
    while pending:
        for r in executor.await_responses(timeout=60.0):
            if r.has_error:
                raise RuntimeError(f"request {r.request_id}: {r.error_msg}")
            if r.result is not None and r.result.is_final:
                tokens += sum(len(t) for t in r.result.output_token_ids)
                pending.discard(r.request_id)
    return time.perf_counter() - t0, tokens


def run_executor_single(executor: Any, prompt: list[int], output: int) -> tuple[float, float]:
    """(TTFT ms, TPOT ms) for one streamed request alone."""
    from worker.executor import Request

    t0 = time.perf_counter()
    rid = executor.enqueue_request(Request(input_token_ids=prompt, max_tokens=output, end_id=-1, streaming=True))
    stamps: list[tuple[float, int]] = []
    seen = 0
    done = False
    while not done:
        for r in executor.await_responses(rid, timeout=60.0):
            if r.has_error:
                raise RuntimeError(r.error_msg)
            assert r.result is not None
            now = time.perf_counter()
            seen += sum(len(t) for t in r.result.output_token_ids)  # streaming: new tokens only
            stamps.append((now, seen))
            done = r.result.is_final
    first = stamps[0][0] - t0
    total = stamps[-1][0] - stamps[0][0]
    return first * 1e3, total / max(stamps[-1][1] - stamps[0][1], 1) * 1e3


def iteration_summary(stats: list[Any]) -> dict[str, float]:
    """Of generation-only (gen) and mixed (ctx: with prompt tokens) iterations: counts, mean
    latencies (ms, launch to results), and `*_step_ms`, the median time from the iteration
    before's results to theirs. The executor launches a step before the last one's results
    are in, so latencies overlap and exceed what a step costs; while the GPU is never idle,
    the time between results is that cost (a mixed step's the prefill chunk's)."""
    gen = [s.iter_latency_ms for s in stats if not s.num_context_requests]
    ctx = [s.iter_latency_ms for s in stats if s.num_context_requests]
    steps: dict[bool, list[float]] = {False: [], True: []}
    for before, s in itertools.pairwise(stats):
        steps[bool(s.num_context_requests)].append((s.timestamp - before.timestamp) * 1e3)

    def median(xs: list[float]) -> float:
        return round(float(np.median(xs)), 2) if xs else math.nan

    return {
        "gen_iters": len(gen),
        "gen_ms": round(float(np.mean(gen)), 2) if gen else math.nan,
        "gen_step_ms": median(steps[False]),
        "ctx_iters": len(ctx),
        "ctx_ms": round(float(np.mean(ctx)), 2) if ctx else math.nan,
        "ctx_step_ms": median(steps[True]),
    }


def dump_iterations(stats: list[Any]) -> None:
    """Every iteration of a run (tokens, requests, latency), for looking at the schedule."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "iterations_128_128.json"), "w") as f:
            json.dump([asdict(s) for s in stats], f, default=str)


def preemptions(executor: Any) -> int:
    """Sequences the scheduler has sent back to recompute so far (MAX_UTILIZATION only)."""
    return int(executor.core.scheduler.num_preemptions)


def mean_decode_batch(stats: list[Any]) -> float:
    gen = [s.num_generation_requests for s in stats if s.num_generation_requests]
    return float(np.mean(gen)) if gen else math.nan


def executor_config(args: argparse.Namespace, kv_cache_dtype: str | None) -> Any:
    """The executor configuration every offline workload runs under (gpu_bench, tp_bench and quant_bench)."""
    from worker.executor import CapacitySchedulerPolicy, ExecutorConfig, KvCacheConfig, SchedulerConfig

    return ExecutorConfig(
        max_batch_size=args.max_batch,
        max_num_tokens=args.max_num_tokens,
        kv_cache_config=KvCacheConfig(tokens_per_block=args.block_size, free_memory_fraction=args.free_memory_fraction,
                                      enable_block_reuse=False, dtype=kv_cache_dtype),
        scheduler_config=SchedulerConfig(CapacitySchedulerPolicy(args.scheduler_policy)),
        iteration_stats_max=1_000_000,
    )  # fmt: skip


def log_fp8_gemm_choices(backend: Any) -> None:
    """What the backend timed for its FP8 GEMMs (the decode graphs' row counts and the full
    prefill chunk's), a line per row count (worker/backends/fp8_gemm.py); nothing for a
    float model."""
    from worker.backends.fp8_gemm import describe

    for rows, timings in sorted(getattr(getattr(backend, "inner", backend), "fp8_gemm_timings", {}).items()):
        log(f"FP8 GEMMs at {rows} rows (out x in: cuBLAS / best Triton us): {describe(timings)}")


def log_decode_graphs(backend: Any) -> None:
    """The decode graphs' replay times and routes (worker/backends/cuda_graphs.py)."""
    graphs = getattr(getattr(backend, "inner", backend), "_graphs", None)
    if graphs is not None and graphs.decode_micros:
        log(graphs.describe())
