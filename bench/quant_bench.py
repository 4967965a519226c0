"""`python -m bench.gpu_bench --quantization fp8|int4`: the executor on the 8B-shaped
random model quantized on the GPU at start, against the roofline recomputed for the
quantized bytes and the FP8 GEMM FLOP/s measured in the same run.

- fp8: 128/128 and 1000/1000 offline throughput with the bf16 KV cache, then both again
  with the FP8 (e4m3) KV cache (its KV tokens reported beside the bf16 cache's).
  `--profile` adds each engine's kernel breakdown of decode steps and a prefill;
  `--workloads` and `--kv-cache-dtype fp8` narrow the runs to those named; `--published`
  runs TensorRT-LLM's published 8B FP8 rows instead. Each row runs as many requests as
  fill its decode batch (bench/row_limits.py) and states that batch and what bounds it.
  Goals: 128/128 >= 28,312 output tok/s (TensorRT-LLM's published H100 FP8 figure for
  Llama-3.1-8B), 1000/1000 >= 15,220; the FP8 cache holds twice the tokens and is not slower.
- int4 (W4A16, RTN: asymmetric groups of 32, as quantizing on load makes them): batch-1
  time per output token against its floor, the int4 weight bytes (plus scales, zeros and
  the bf16 lm head) over the measured bandwidth; goal <= 1.3x. Per projection, the batch-1
  kernel also runs on groups of 128, symmetric (the bytes of the usual checkpoints), to show
  what the small groups cost.

Random weights are what the bench measures speed with (quantized RTN / per-channel like
any others); their outputs are meaningless.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from functools import partial
from typing import Any

import numpy as np
import torch

from bench import log
from bench.device_rates import (
    SUSTAINED_S,
    graph_call_seconds,
    measure_bandwidth,
    measure_fp8_gemm,
    measure_gemm,
    sustained_note,
    sync,
)
from bench.environment import environment
from bench.model_shapes import LLAMA_8B, TINY
from bench.offline_runs import published_figure, row_plan
from bench.random_weights import random_weights
from bench.roofline import Roofline, quantized_roofline
from bench.row_limits import BatchLimits, decode_resource
from bench.runner import (
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
from bench.workloads import prompts_for, select_workloads
from worker.models.quantization import INT4_GROUP_SIZE

GOALS_TOK_S = {"128/128": 28_312, "1000/1000": 15_220}
INT4_TPOT_GOAL = 1.3  # x the floor
# (prompt, output, requests: 0 as many as fill the batch); the goals' two rows unless named
FP8_WORKLOADS = [(128, 128, 0), (128, 2048, 0), (2048, 128, 0), (1000, 1000, 0), (2048, 2048, 0)]
FP8_DEFAULT = ("128/128", "1000/1000")
TINY_WORKLOADS = [(16, 16, 0)]


def int4_gemv_rows(cfg: Any, bandwidth: float, device: torch.device) -> list[dict[str, Any]]:
    """Batch-1 W4A16 per projection shape and group scheme (on load's asymmetric groups of
    32; symmetric groups of 128): the GEMV kernel against the tiled kernel it replaced for
    one row, and against its floor (the packed weights, group scales and zeros over the
    measured bandwidth)."""
    from worker.backends.quant_linear import quantize_int4, w4a16_matmul

    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"qkv": (h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d), "o": (cfg.num_heads * d, h),
              "gate_up": (h, 2 * inter), "down": (inter, h)}  # fmt: skip
    rows = []
    for group, symmetric in ((INT4_GROUP_SIZE, False), (128, True)):
        for role, (k, n) in shapes.items():
            layer = quantize_int4(torch.randn(n, k, device=device) * 0.02, None, group, symmetric)
            x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
            gemv = graph_call_seconds(partial(layer, x), device)
            tiled = graph_call_seconds(
                partial(w4a16_matmul, x, layer.qweight, layer.scale, layer.zero, layer.group_size), device
            )
            floor = (k * n // 2 + k // group * n * (4 if symmetric else 8)) / bandwidth
            rows.append({"projection": role, "groups": f"{group}{' sym' if symmetric else ' asym'}", "k": k, "n": n,
                         "gemv_us": round(gemv * 1e6, 1), "tiled_us": round(tiled * 1e6, 1),
                         "floor_us": round(floor * 1e6, 1), "of_floor": round(gemv / floor, 2)})  # fmt: skip
            log(f"int4 batch-1 {role}: {rows[-1]}")
    return rows


def _engine(args: argparse.Namespace, cfg: Any, weights: dict[str, torch.Tensor], device: torch.device,
            kv_cache_dtype: str | None, last: bool) -> Any:  # fmt: skip
    """The executor over `weights` quantized on the GPU. The `last` engine takes the bf16
    source weights out of `weights` before its KV cache is sized, so the cache gets the
    memory a quantized checkpoint would leave it (the engines before need them again)."""
    from worker.backends.torch_backend import TorchBackend
    from worker.executor import EngineCore, Executor

    t0 = time.perf_counter()
    backend = TorchBackend(cfg, device, "bfloat16", weights=weights, max_num_tokens=args.max_num_tokens,
                           max_model_len=args.max_model_len, max_graph_batch=args.max_batch,
                           quantization=args.quantization, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    sync(device)
    log(f"{args.quantization} model built (quantized on the GPU) in {time.perf_counter() - t0:.1f} s, "
        f"{torch.cuda.memory_allocated(device) / 1e9 if device.type == 'cuda' else 0:.1f} GB allocated")  # fmt: skip
    if last:
        weights.clear()  # what the backend kept (the bf16 embedding and lm head) stays alive through it
        gc.collect()
        if device.type == "cuda":
            log(f"bf16 source weights released: {torch.cuda.memory_allocated(device) / 1e9:.1f} GB allocated")
    executor = Executor(EngineCore(backend, executor_config(args, kv_cache_dtype)))
    log_fp8_gemm_choices(backend)
    log_decode_graphs(backend)
    run_executor_offline(executor, prompts_for(4, 64, cfg.vocab_size, 99), 8)  # warm-up: Triton compiles
    return executor


def _offline(args: argparse.Namespace, executor: Any, cfg: Any, prompt: int, output: int, given: int,
             roof: Roofline) -> dict[str, Any]:  # fmt: skip
    kv_tokens = executor.core.blocks.num_blocks * args.block_size
    limits = BatchLimits(args.max_batch, kv_tokens, args.block_size, args.max_num_tokens)
    plan = row_plan(args, prompt, output, given, limits, roof)
    n, policy = plan.requests, args.scheduler_policy
    log(f"{prompt}/{output}: {n} requests; decode batch up to {plan.batch_cap} ({plan.bound}), "
        f"{plan.expected_batch:.0f} expected; {plan.roofline_seconds:.0f} s at the roofline")  # fmt: skip
    executor.get_latest_iteration_stats()
    preempted = preemptions(executor)
    seconds, tokens = run_executor_offline(executor, prompts_for(n, prompt, cfg.vocab_size, 1), output)
    if tokens != n * output:
        raise RuntimeError(f"{prompt}/{output}: {tokens} output tokens, expected {n * output}")
    stats = executor.get_latest_iteration_stats()
    row = {
        "workload": f"{prompt}/{output}", "requests": n, "tok_s": round(tokens / seconds),
        "roofline_tok_s": round(roof.for_schedule(prompt, output, n, args.max_batch, kv_tokens, policy)),
        "sustained_roofline_tok_s": round(sustained.for_schedule(prompt, output, n, args.max_batch, kv_tokens, policy))
        if (sustained := roof.at_sustained()) is not None else None,
        "mean_batch": round(mean_decode_batch(stats), 1), "batch_cap": plan.batch_cap, "batch_bound": plan.bound,
        "expected_batch": round(plan.expected_batch, 1),
        "decode_bound": decode_resource(roof, prompt, output, plan.batch_cap), "kv_tokens": kv_tokens,
        "preemptions": preemptions(executor) - preempted, "wall_s": round(seconds, 2), **iteration_summary(stats),
    }  # fmt: skip
    published = published_figure(args, executor.core.backend, row["workload"])
    if published > 0:
        row["published_tok_s"] = round(published)
        row["of_published"] = round(row["tok_s"] / published, 3)
    goal = GOALS_TOK_S.get(row["workload"])
    if goal:
        row["goal_tok_s"] = goal
        row["of_goal"] = round(row["tok_s"] / goal, 3)
    return row


def run_quantized(args: argparse.Namespace) -> list[dict[str, Any]]:
    from worker.models.config import ModelConfig

    device = torch.device(args.device)
    cfg = ModelConfig.from_hf(TINY if args.tiny else LLAMA_8B)
    env = environment(device)
    log("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    bandwidth, bf16_flops = measure_bandwidth(device), measure_gemm(device)
    fp8_flops = measure_fp8_gemm(device) if args.quantization == "fp8" else float("nan")
    flops = fp8_flops if args.quantization == "fp8" else bf16_flops
    sustained = float("nan")
    if device.type == "cuda":
        sustained = (measure_fp8_gemm if args.quantization == "fp8" else measure_gemm)(device, SUSTAINED_S)
    log(f"HBM {bandwidth / 1e12:.2f} TB/s; GEMM bf16 {bf16_flops / 1e12:.0f} TFLOP/s, fp8 {fp8_flops / 1e12:.0f} "
        f"TFLOP/s (8192^3, 20 products, measured now); the roofline's GEMM "
        f"{'fp8' if args.quantization == 'fp8' else 'bf16'}{sustained_note(sustained)}")  # fmt: skip
    gemv = int4_gemv_rows(cfg, bandwidth, device) if args.quantization == "int4" and device.type == "cuda" else []
    weights = random_weights(cfg, device, torch.bfloat16)
    rows: list[dict[str, Any]] = []
    workloads = (
        select_workloads(TINY_WORKLOADS, args) if args.tiny else select_workloads(FP8_WORKLOADS, args, FP8_DEFAULT)
    )
    kv_runs: list[str | None] = [None, "fp8"] if args.quantization == "fp8" else [None]
    if args.kv_cache_dtype == "fp8" and args.quantization == "fp8":  # the FP8 cache's rows alone
        kv_runs = ["fp8"]
    for kv in kv_runs:
        roof = quantized_roofline(cfg, args.quantization, 1 if kv == "fp8" else 2, bandwidth, flops)
        roof.sustained_flops = sustained
        executor = _engine(args, cfg, weights, device, kv, last=kv == kv_runs[-1])
        first = kv == kv_runs[0]  # the engine that also runs the batch-1 row
        if first:
            log(f"roofline: weights {roof.weight_bytes / 1e9:.2f} GB read per step -> batch-1 TPOT floor "
                f"{roof.decode_floor(0) * 1e3:.2f} ms")  # fmt: skip
        for prompt, output, n in workloads if args.quantization == "fp8" else []:
            row = _offline(args, executor, cfg, prompt, output, n, roof)
            row["kv_cache"] = kv or "bf16"
            rows.append(row)
            log(f"{args.quantization} weights, {row['kv_cache']} KV: {row}")
        if first:
            prompt, output = (16, 16) if args.tiny else (128, 128)
            ttft, tpot = run_executor_single(executor, prompts_for(1, prompt, cfg.vocab_size, 2)[0], output)
            floor = roof.decode_floor(prompt + output // 2) * 1e3
            single = {"workload": f"batch 1, {prompt}/{output}", "ttft_ms": round(ttft, 2), "tpot_ms": round(tpot, 3),
                      "tpot_floor_ms": round(floor, 3), "of_floor": round(tpot / floor, 2),
                      "kv_cache": kv or "bf16"}  # fmt: skip
            if args.quantization == "int4":
                single["goal_of_floor"] = INT4_TPOT_GOAL
            rows.append(single)
            log(f"{args.quantization} batch 1: {single}")
        if args.profile and device.type == "cuda":
            # decode steps of 128/128 at batch 512 and 1024, 1000/1000 at the batch its KV cache holds, a prefill
            fits = executor.core.blocks.num_blocks * args.block_size // 2000
            steps = [(512, 1, 192), (1024, 1, 192), (min(fits, args.max_batch), 1, 1536), (64, 128, 128), (1, 1, 2048)]
            profile_steps(executor.core.backend, cfg, executor.core.blocks.num_blocks, args.block_size, steps,
                          f"profile_{args.quantization}_kv_{kv or 'bf16'}")  # fmt: skip
        executor.shutdown()
        del executor
        gc.collect()
        torch.cuda.empty_cache()
    summary = {
        "environment": env, "quantization": args.quantization, "bandwidth_TBps": bandwidth / 1e12,
        "max_batch": args.max_batch, "max_num_tokens": args.max_num_tokens,
        "free_memory_fraction": args.free_memory_fraction,
        "gemm_bf16_TFLOPps": bf16_flops / 1e12, "gemm_fp8_TFLOPps": fp8_flops / 1e12,
        "gemm_sustained_TFLOPps": sustained / 1e12, "rows": rows,
        "int4_batch1_gemv": gemv,
    }  # fmt: skip
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"gpu_bench_{args.quantization}.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    print(json.dumps(summary, indent=1, default=str))
    long = [r for r in rows if r.get("workload") == "1000/1000"]
    if len(long) == 2:
        print(f"FP8 KV cache: {long[1]['kv_tokens'] / long[0]['kv_tokens']:.2f}x the KV tokens, "
              f"{long[1]['tok_s'] / long[0]['tok_s']:.2f}x the 1000/1000 throughput")  # fmt: skip
    return rows


def table_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = ["workload", "KV cache", "reqs", "tok/s", "TensorRT-LLM published (share)", "goal", "roofline tok/s",
              "at sustained GEMM rate", "decode bound", "mean batch (cap: bound)", "TPOT ms", "TPOT floor ms",
              "KV tokens"]  # fmt: skip
    body = [[str(r.get("workload")), str(r.get("kv_cache", "bf16")), f"{r.get('requests', '')}",
             f"{r.get('tok_s', np.nan):,}",
             f"{r['published_tok_s']:,} ({r['of_published']:.2f})" if "published_tok_s" in r else "",
             f"{r.get('goal_tok_s', '')}", f"{r.get('roofline_tok_s', '')}",
             f"{r.get('sustained_roofline_tok_s') or ''}", f"{r.get('decode_bound', '')}",
             f"{r['mean_batch']:.0f} ({r['batch_cap']}: {r['batch_bound']})" if "batch_cap" in r else "",
             f"{r.get('tpot_ms', '')}", f"{r.get('tpot_floor_ms', '')}", f"{r.get('kv_tokens', '')}"]
            for r in rows]  # fmt: skip
    return header, body
