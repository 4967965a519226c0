"""The offline workloads through an Executor over a backend (one GPU's, or rank 0's of several),
a Row each: throughput against the roofline and TensorRT-LLM's published figure, the decode
batch against what bounds it, batch-1 TTFT and TPOT, what the iterations did."""

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
from bench.published import published_tok_s
from bench.roofline import Roofline
from bench.row_limits import BatchLimits, RequestPlan, plan_at, plan_requests
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
    batch_cap: int = 0  # the decode batch the engine's limits allow (bench/row_limits.py)
    batch_bound: str = ""  # the limit that is, or what kept the batch short of it
    published_tok_s: float = math.nan  # TensorRT-LLM's figure for the same setup (bench/published.py)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def hf_tok_s(self) -> float:
        return self.hf_output_tokens / self.hf_seconds if self.hf_output_tokens else math.nan


def device_is_cuda(backend: Any) -> bool:
    return getattr(getattr(backend, "device", None), "type", None) == "cuda"


def row_plan(args: argparse.Namespace, prompt: int, output: int, requests: int, limits: BatchLimits,
             roof: Roofline) -> RequestPlan:  # fmt: skip
    """A row's requests: `requests` where the workload names them, else `--requests`, else
    planned from the engine's limits (row_limits.plan_requests, in `--row-seconds` of
    roofline time), each multiplied by `--scale`; the time estimate at the sustained GEMM rate."""
    held = roof.at_sustained() or roof
    given = requests or args.requests
    if not given and args.scale == 1.0:
        return plan_requests(prompt, output, limits, held, args.row_seconds, args.min_row_seconds)
    if not given:
        given = plan_requests(prompt, output, limits, held, args.row_seconds, args.min_row_seconds).requests
    return plan_at(prompt, output, max(1, int(given * args.scale)), limits, held, "requests")


def published_figure(args: argparse.Namespace, backend: Any, workload: str) -> float:
    """TensorRT-LLM's published tok/s for this run's setup and workload, or nan."""
    gpu = torch.cuda.get_device_name(backend.device) if device_is_cuda(backend) else "cpu"
    tensor_parallel = args.tensor_parallel_size if args.pipeline_parallel_size == 1 else 0
    figure = published_tok_s(gpu, args.model_shape, args.quantization, tensor_parallel, workload)
    return math.nan if figure is None else float(figure)


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
    limits = BatchLimits(args.max_batch, kv_tokens, args.block_size, args.max_num_tokens)
    for prompt, output, given, _ in workloads:
        name = f"{prompt}/{output}"
        plan = row_plan(args, prompt, output, given, limits, roof)
        n = plan.requests
        log(f"tokenwire {name}: {n} requests; decode batch up to {plan.batch_cap} ({plan.bound}), "
            f"{plan.expected_batch:.0f} expected; {plan.roofline_seconds:.0f} s at the roofline")  # fmt: skip
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
        row = Row(name, n, seconds, tokens, ttft_ms=ttft, tpot_ms=tpot, mean_batch=batch, batch_cap=plan.batch_cap,
                  batch_bound=plan.bound, published_tok_s=published_figure(args, backend, name))  # fmt: skip
        row.extra = {**summary, **host, "kv_tokens": kv_tokens, "max_batch": args.max_batch,
                     "expected_batch": round(plan.expected_batch, 1),
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
        for row, (prompt, output, _, _) in zip(rows, workloads, strict=True):
            prompts = np.asarray(prompts_for(row.requests, prompt, cfg.vocab_size, 1))
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
