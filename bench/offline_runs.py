"""The offline workloads through an Executor over a backend (one GPU's, or rank 0's of several),
a Row each: throughput against the roofline, batch-1 TTFT and TPOT, what the iterations did."""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bench import log
from bench.direct_loop import run_direct
from bench.host_timing import HostTimer, summarize
from bench.roofline import Roofline
from bench.runner import (
    dump_iterations,
    executor_config,
    iteration_summary,
    log_decode_graphs,
    log_fp8_gemm_choices,
    mean_decode_batch,
    preemptions,
    run_executor_offline,
    run_executor_single,
)
from bench.step_profile import profile_steps
from bench.workloads import prompts_for


@dataclass(slots=True)
class Row:
    workload: str
    requests: int
    seconds: float
    output_tokens: int
    hf_requests: int = 0
    hf_seconds: float = math.nan
    hf_output_tokens: int = 0
    hf_error: str = ""
    ttft_ms: float = math.nan
    tpot_ms: float = math.nan
    roofline_tok_s: float = math.nan
    mean_batch: float = math.nan
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def hf_tok_s(self) -> float:
        return self.hf_output_tokens / self.hf_seconds if self.hf_output_tokens else math.nan


def device_is_cuda(backend: Any) -> bool:
    return getattr(getattr(backend, "device", None), "type", None) == "cuda"


def bench_executor(args: argparse.Namespace, cfg: Any, backend: Any, workloads: list[tuple[int, int, int, int]],
                   roof: Roofline) -> list[Row]:  # fmt: skip
    """The executor over `backend` (a TorchBackend, or tensor-parallel rank 0's backend)."""
    from worker.executor import EngineCore, Executor

    config = executor_config(args, args.kv_cache_dtype)
    t0 = time.perf_counter()
    # --direct and the host timer drive one backend
    single_device = getattr(args, "tensor_parallel_size", 1) * getattr(args, "pipeline_parallel_size", 1) == 1
    timer = HostTimer(backend) if args.profile and single_device else None  # before the core binds `launch`
    core = EngineCore(backend, config)
    if timer is not None:
        timer.attach(core)
    executor = Executor(core)
    kv_tokens = executor.core.blocks.num_blocks * args.block_size
    working = backend.working_memory() if hasattr(backend, "working_memory") else None
    log(f"executor up in {time.perf_counter() - t0:.1f} s (its decode CUDA graphs captured and timed): "
        f"{executor.core.blocks.num_blocks} KV blocks of {args.block_size} ({kv_tokens} tokens: max_batch "
        f"{args.max_batch} x {kv_tokens // args.max_batch})"
        + (f"; working memory {working.describe()}" if working else ""))  # fmt: skip
    if device_is_cuda(backend):
        log(f"GPU memory: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, "
            f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved by torch, "
            f"{torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB free")  # fmt: skip
    log_fp8_gemm_choices(backend)
    log_decode_graphs(backend)
    # Warm-up: compiles the Triton kernels for prefill shapes, touches every path once.
    run_executor_offline(executor, prompts_for(4, 64, cfg.vocab_size, 99), 8)
    # ... and a prompt alone: its prefill keeps a single logits row, a shape of its own for the kernels.
    run_executor_single(executor, prompts_for(1, 64, cfg.vocab_size, 98)[0], 4)
    rows = []
    for prompt, output, n, _ in workloads:
        name = f"{prompt}/{output}"
        executor.get_latest_iteration_stats()  # drains: what follows is this run's alone
        preempted = preemptions(executor)
        if timer is not None:
            timer.take()
        seconds, tokens = run_executor_offline(executor, prompts_for(n, prompt, cfg.vocab_size, 1), output)
        stats = executor.get_latest_iteration_stats()
        host = summarize(timer.take()) if timer is not None else {}
        if tokens != n * output:
            raise RuntimeError(f"{name}: {tokens} output tokens, expected {n * output}")
        batch = mean_decode_batch(stats)
        summary = iteration_summary(stats)
        if prompt == 128 and output == 128:
            dump_iterations(stats)
        ttft, tpot = run_executor_single(executor, prompts_for(1, prompt, cfg.vocab_size, 2)[0], output)
        row = Row(name, n, seconds, tokens, ttft_ms=ttft, tpot_ms=tpot, mean_batch=batch)
        row.extra = {**summary, **host, "kv_tokens": kv_tokens, "max_batch": args.max_batch,
                     "preemptions": preemptions(executor) - preempted}  # fmt: skip
        row.roofline_tok_s = roof.for_schedule(prompt, output, n, args.max_batch, kv_tokens, args.scheduler_policy)
        if (sustained := roof.at_sustained()) is not None:
            row.extra["sustained_roofline_tok_s"] = sustained.for_schedule(prompt, output, n, args.max_batch, kv_tokens,
                                                                           args.scheduler_policy)  # fmt: skip
        row.extra["tpot_floor_ms"] = roof.decode_floor(prompt + output // 2) * 1e3
        log(f"tokenwire {name}: {row.tok_s:,.0f} tok/s (mean decode batch {batch:.0f}), "
            f"TTFT {ttft:.1f} ms, TPOT {tpot:.2f} ms; iterations {row.extra}")  # fmt: skip
        rows.append(row)
    if args.direct and single_device:
        for row, (prompt, output, n, _) in zip(rows, workloads, strict=True):
            prompts = np.asarray(prompts_for(n, prompt, cfg.vocab_size, 1))
            seconds, tokens = run_direct(backend, prompts, output, args.max_batch, args.max_num_tokens,
                                         args.block_size, executor.core.blocks.num_blocks)  # fmt: skip
            row.extra["direct_tok_s"] = round(tokens / seconds)
            log(f"backend alone {row.workload}: {tokens / seconds:,.0f} tok/s")
    if args.profile:  # over ranks: rank 0's kernels, its collectives included
        try:
            profile_steps(backend, cfg, executor.core.blocks.num_blocks, args.block_size)
        except Exception as e:  # a diagnostic; never lose the table for it
            log(f"profile failed: {type(e).__name__}: {e}")
    executor.shutdown()
    return rows
