"""The executor on CUDA (torch backend) against transformers' continuous batching
(`generate_batch`) and the roofline, on a Llama-3.1-8B-shaped model with random bf16
weights made on the GPU and shared by both engines (no second copy).

Workloads: fixed prompt / output lengths, EOS ignored. Offline throughput (all
requests enqueued at once) in output tokens/s; TTFT and time per output token
(TPOT) for one request alone. The roofline comes from the HBM bandwidth (a large
device-to-device copy, bytes read + written) and bf16 GEMM FLOP/s (8192^3 on random
data) measured in the same run. A row runs as many requests as fill the decode batch
its limits allow (the batch cap, the KV cache, the token budget: bench/row_limits.py)
within --row-seconds of roofline time, unless --requests says how many; it states
that batch, what bounds it, and TensorRT-LLM's published figure where there is one
(bench/published.py).

    python -m bench.gpu_bench                 # everything
    python -m bench.gpu_bench --skip-hf       # tokenwire only
    python -m bench.gpu_bench --quantization fp8 --kv-cache-dtype fp8 --published
                                              # TensorRT-LLM's published 8B FP8 rows
    python -m bench.gpu_bench --tiny --device cpu   # a smoke run of the code paths

Needs only torch, triton, numpy, safetensors, tokenizers and transformers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import asdict
from typing import Any

import torch

from bench import SkipSection, log
from bench.device_rates import SUSTAINED_S, measure_bandwidth, measure_gemm, sustained_note, sync
from bench.environment import environment
from bench.model_shapes import EXPERT_DTYPES, SHAPES, expert_dtype, hf_config, shape_name
from bench.offline_runs import Row, bench_executor
from bench.random_weights import random_weights
from bench.roofline import Roofline, roofline_of
from bench.row_limits import decode_resource
from bench.saved_runs import saved_roofline, saved_roofline_tok_s
from bench.transformers_peer import bench_transformers, transformers_model
from bench.workloads import select_workloads

TITLE = "GPU: tokenwire (torch backend) vs transformers generate_batch, Llama-3.1-8B shape, random bf16"


# (prompt, output, requests for tokenwire, requests for transformers); tokenwire's 0: as
# many as fill the batch (bench/row_limits.py). transformers gets a few: it runs at a few
# hundred tokens/s here (see the table).
WORKLOADS = [(128, 128, 0, 32), (128, 2048, 0, 16), (2048, 128, 0, 32), (1000, 1000, 0, 16), (2048, 2048, 0, 8)]
TINY_WORKLOADS = [(16, 16, 0, 4), (16, 64, 0, 2), (64, 8, 0, 2)]
# The engine's limits under --published, where not given: the KV memory fraction of
# TensorRT-LLM's published runs; a batch cap above the sequences an H200's FP8 KV cache
# holds at the published rows of 1,000 tokens and more (about 400-800), where 128/128's
# decode steps are GEMM-bound long before it; a token budget at which 2048/128's
# prefills leave room for that batch (row_limits.budget_batch) rather than bound it.
PUBLISHED_LIMITS = {"free_memory_fraction": 0.95, "max_batch": 1024, "max_num_tokens": 16384}


def bench_tokenwire(args: argparse.Namespace, cfg: Any, weights: dict[str, torch.Tensor], device: torch.device,
                    workloads: list[tuple[int, int, int, int]], roof: Roofline) -> list[Row]:  # fmt: skip
    from worker.backends.torch_backend import TorchBackend

    backend = TorchBackend(cfg, device, args.dtype, weights=weights, max_num_tokens=args.max_num_tokens,
                           max_model_len=args.max_model_len, max_graph_batch=args.max_batch,
                           max_batch_size=args.max_batch, kv_cache_dtype=args.kv_cache_dtype,
                           deterministic=args.deterministic)  # fmt: skip
    rows = bench_executor(args, cfg, backend, workloads, roof)
    del backend
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


# -- the table ---------------------------------------------------------------------------------------------


def format_rows(rows: list[Row], roof: Roofline) -> tuple[list[str], list[list[str]]]:
    header = ["workload", "reqs", "tokenwire tok/s", "TensorRT-LLM published (share)", "HF reqs", "HF CB tok/s",
              "vs HF", "roofline tok/s", "of roofline", "at sustained GEMM rate (of it)", "decode bound",
              "mean batch (cap: bound)", "KV tokens", "backend alone tok/s", "TTFT b1 ms", "TPOT b1 ms",
              "TPOT floor ms", "TPOT/floor"]  # fmt: skip
    profiled = any("host_ms" in r.extra for r in rows)
    if profiled:  # --profile: is the host on the critical path?
        header += ["step ms", "host ms/step", "GPU wait ms/step", "steps host-bound"]
    out = []
    for r in rows:
        floor_ms = r.extra.get("tpot_floor_ms", roof.decode_floor(0) * 1e3)
        prompt, output = (int(x) for x in r.workload.split("/"))
        out.append([
            r.workload, str(r.requests), f"{r.tok_s:,.0f}",
            f"{r.published_tok_s:,.0f} ({r.tok_s / r.published_tok_s:.2f})" if r.published_tok_s > 0 else "-",
            str(r.hf_requests) if r.hf_requests else "-",
            f"{r.hf_tok_s:,.0f}" if r.hf_output_tokens else (r.hf_error or "-"),
            f"{r.tok_s / r.hf_tok_s:.1f}x" if r.hf_output_tokens else "-",
            f"{r.roofline_tok_s:,.0f}", f"{r.tok_s / r.roofline_tok_s:.0%}",
            f"{sustained:,.0f} ({r.tok_s / sustained:.0%})" if (sustained := r.extra.get("sustained_roofline_tok_s"))
            else "-",
            decode_resource(roof, prompt, output, r.batch_cap) if r.batch_cap else "-",
            f"{r.mean_batch:.0f} ({r.batch_cap}: {r.batch_bound})" if r.batch_cap else f"{r.mean_batch:.0f}",
            f"{r.extra['kv_tokens']:,.0f}" if "kv_tokens" in r.extra else "-",
            f"{r.extra['direct_tok_s']:,.0f}" if "direct_tok_s" in r.extra else "-",
            f"{r.ttft_ms:.1f}", f"{r.tpot_ms:.2f}", f"{floor_ms:.2f}", f"{r.tpot_ms / floor_ms:.2f}",
        ])  # fmt: skip
        if profiled:
            e = r.extra
            out[-1] += ([f"{e['step_ms']:.2f}", f"{e['host_ms']:.2f}", f"{e['gpu_wait_ms']:.2f}",
                         f"{e['host_bound_steps']:.0%}"] if "host_ms" in e else ["-"] * 4)  # fmt: skip
    return header, out


def run(args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    from worker.models.config import ModelConfig

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SkipSection("no CUDA device")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    hf_cfg = hf_config(shape_name(args.model_shape, args.tiny))
    args.expert_dtype = expert_dtype(args.model_shape, args.expert_dtype)
    workloads = select_workloads(TINY_WORKLOADS if args.tiny else WORKLOADS, args)
    if args.scale != 1.0:  # tokenwire's counts: where they are planned (offline_runs.row_plan)
        workloads = [(p, o, n, max(1, int(m * args.scale))) for p, o, n, m in workloads]
    cfg = ModelConfig.from_hf(hf_cfg)
    env = environment(device)
    log("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    weights: dict[str, torch.Tensor] = {}
    gpus = args.tensor_parallel_size * args.pipeline_parallel_size
    if over_ranks(args):
        from bench import tp_bench

        rows, roof, bandwidth, flops = tp_bench.run(args, workloads, env)
        args.skip_hf = True
    else:
        bandwidth, flops = measure_bandwidth(device), measure_gemm(device)
        roof = roofline_of(cfg, None, dtype.itemsize, bandwidth, flops, kv_cache_dtype=args.kv_cache_dtype)
        if device.type == "cuda":
            roof.sustained_flops = measure_gemm(device, SUSTAINED_S)
        floor_ms = roof.decode_floor(0) * 1e3
        log(f"roofline: {bandwidth / 1e12:.2f} TB/s, {flops / 1e12:.0f} TFLOP/s{sustained_note(roof.sustained_flops)}; "
            f"weights {roof.weight_bytes / 1e9:.2f} GB{roof.experts_note()} -> "
            f"batch-1 TPOT floor {floor_ms:.2f} ms")  # fmt: skip
        t0 = time.perf_counter()
        weights = random_weights(cfg, device, dtype)
        sync(device)
        log(f"random weights made in {time.perf_counter() - t0:.1f} s")
        rows = bench_tokenwire(args, cfg, weights, device, workloads, roof)

    def save() -> None:  # after each engine, so a run cut short still leaves its figures
        summary = {
            "environment": env,
            "bandwidth_TBps": bandwidth / 1e12,
            "gemm_TFLOPps": flops / 1e12,
            "gemm_sustained_TFLOPps": roof.sustained_flops / 1e12,
            "weight_GB": roof.weight_bytes / 1e9,
            "expert_GB": roof.expert_bytes * roof.experts / 1e9,
            "model_shape": shape_name(args.model_shape, args.tiny),
            "tensor_parallel_size": args.tensor_parallel_size,
            "pipeline_parallel_size": args.pipeline_parallel_size,
            "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype,
            "expert_dtype": args.expert_dtype,
            "scheduler_policy": args.scheduler_policy,
            "dtype": args.dtype,
            "max_batch": args.max_batch,
            "max_num_tokens": args.max_num_tokens,
            "free_memory_fraction": args.free_memory_fraction,
            "rows": [asdict(r) | {"tok_s": r.tok_s, "hf_tok_s": r.hf_tok_s} for r in rows],
        }
        out = os.environ.get("OUT")
        if out:
            split = f"tp{args.tensor_parallel_size}" + (f"_pp{pp}" if (pp := args.pipeline_parallel_size) > 1 else "")
            quant = f"_{args.quantization}" if args.quantization else ""
            quant += "_mxfp4" if args.expert_dtype == "mxfp4" else ""
            shape = shape_name(args.model_shape, args.tiny)
            name = f"gpu_bench_{shape}_{split}{quant}.json" if over_ranks(args) else "gpu_bench.json"
            with open(os.path.join(out, name), "w") as f:
                json.dump(summary, f, indent=1, default=str)

    save()
    if not args.skip_hf:
        model = transformers_model(hf_cfg, cfg, weights, device)
        bench_transformers(model, rows, workloads, cfg.vocab_size, args.hf_budget, save)
    header, table = format_rows(rows, roof)
    print(f"\n{env.get('gpu', 'cpu')} | torch {env['torch']} | triton {env['triton']} | transformers "
          f"{env['transformers']} | {env['date']}")  # fmt: skip
    gemm = "fp8" if args.quantization == "fp8" and device.type == "cuda" else "bf16"
    print(f"roofline inputs: HBM {bandwidth / 1e12:.2f} TB/s (D2D copy, read+write), {gemm} GEMM {flops / 1e12:.0f} "
          f"TFLOP/s (8192^3, 20 products{sustained_note(roof.sustained_flops)}), summed over {gpus} GPU(s); "
          f"{args.quantization or args.dtype} weights {roof.weight_bytes / 1e9:.2f} GB read per step"
          f"{roof.experts_note()}")  # fmt: skip
    return header, table


def table_from_json(path: str) -> tuple[list[str], list[list[str]]]:
    """Re-render a saved run's table (the roofline recomputed from its measured ceilings)."""
    with open(path) as f:
        saved = json.load(f)
    roof = saved_roofline(saved)
    fields = set(Row.__dataclass_fields__)
    rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in saved["rows"]]
    for row in rows:
        row.roofline_tok_s = saved_roofline_tok_s(roof, saved, row.workload, row.requests, row.extra)
    env = saved["environment"]
    print(f"{env.get('gpu', 'cpu')} | torch {env['torch']} | triton {env['triton']} | transformers "
          f"{env['transformers']} | {env['date']}")  # fmt: skip
    return format_rows(rows, roof)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tiny", action="store_true", help="a tiny model: check the code paths, not the speed")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--workloads", default="", help="comma-separated prompt/output pairs to run, e.g. 128/128")
    p.add_argument("--published", action="store_true",
                   help="the workloads TensorRT-LLM published figures for at this model shape, quantization and "
                        "tensor-parallel size (bench/published.py), under PUBLISHED_LIMITS unless given")  # fmt: skip
    p.add_argument("--scale", type=float, default=1.0, help="multiply every request count")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per row (0: as many as fill the batch the engine's limits allow, within "
                        "--row-seconds: bench/row_limits.py)")  # fmt: skip
    p.add_argument("--row-seconds", type=float, default=60.0,
                   help="the most roofline time (at the sustained GEMM rate) a row's planned requests take; "
                        "a row runs longer by 1 / its share of the roofline")  # fmt: skip
    p.add_argument("--min-row-seconds", type=float, default=10.0,
                   help="the least roofline time a row's planned requests take, so ramp and drain are a small "
                        "part of what is timed (0 with --tiny)")  # fmt: skip
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--scheduler-policy", default="guaranteed_no_evict",
                   choices=["guaranteed_no_evict", "max_utilization"],
                   help="the capacity scheduler policy (TensorRT-LLM's default, or admit on current length "
                        "and preempt by recompute); the roofline is that policy's schedule at the floor")  # fmt: skip
    p.add_argument("--free-memory-fraction", type=float, default=0.9,
                   help="of the device memory free after the weights and working memory, what the KV cache takes "
                        "(TensorRT-LLM's kv_cache_free_gpu_mem_fraction: 0.9 by default, 0.95 in its published runs)")
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--deterministic", action="store_true",
                   help="the backend's batch-invariant mode (a row's logits independent of its batch-mates)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--direct", action="store_true", help="also drive the backend alone, without the executor")
    p.add_argument("--table-from", default="", help="print the table of a saved gpu_bench.json and exit")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch the Triton kernels without programmatic dependent launch (worker/backends/pdl.py)")
    p.add_argument("--profile", action="store_true",
                   help="per-step host time in the runs (prepare, launch, GPU wait; bench/host_timing.py), "
                        "then single backend steps and their kernel breakdown")  # fmt: skip
    p.add_argument("--hf-budget", type=float, default=240.0, help="seconds for transformers before skipping")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs the model is split over, one process each (bench/tp_bench.py); no transformers run")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages, each over --tensor-parallel-size GPUs (bench/tp_bench.py)")
    p.add_argument("--micro-batches", type=int, default=0,
                   help="pipeline micro-batches per step (0: one per stage)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["fp8"],
                   help="an e4m3 KV cache; with --quantization fp8 on one GPU, only the FP8-cache rows of "
                        "bench/quant_bench.py (which runs both caches without it)")  # fmt: skip
    p.add_argument("--model-shape", default="8b", choices=list(SHAPES),
                   help="Llama-3.1-8B or -70B, Qwen3-8B, Gemma-3-12B (text), Qwen3-30B-A3B, gpt-oss-20b or "
                        "-120b shape (bench/model_shapes.py; 70b needs enough GPUs for its shards)")  # fmt: skip
    p.add_argument("--expert-dtype", default=None, choices=EXPERT_DTYPES,
                   help="the experts' weights: gpt-oss's packed MXFP4 as it ships (its default: the 120b shape "
                        "fits one 141 GB GPU so) or bf16; the other shapes' are bf16")  # fmt: skip
    p.add_argument("--quantization", default=None, choices=["fp8", "int4"],
                   help="quantize the model at start: on one GPU at the 8B shape bench/quant_bench.py's "
                        "workloads; over several GPUs or at the 70B shape these (bench/tp_bench.py)")  # fmt: skip
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with PUBLISHED_LIMITS under --published and no least row time under
    --tiny (a flag given wins over either)."""
    args = parser().parse_args(argv)
    defaults: dict[str, float] = {**(PUBLISHED_LIMITS if args.published else {}),
                                  **({"min_row_seconds": 0.0} if args.tiny else {})}  # fmt: skip
    if not defaults:
        return args
    p = parser()
    p.set_defaults(**defaults)
    return p.parse_args(argv)


def over_ranks(args: argparse.Namespace) -> bool:
    """Whether the model runs over rank processes (bench/tp_bench.py): several GPUs, or a
    shape other than Llama-3.1-8B (each rank makes its tensors from the family's list);
    otherwise it is the 8B shape on one GPU, in this process."""
    return args.tensor_parallel_size * args.pipeline_parallel_size > 1 or args.model_shape != "8b"


def table() -> tuple[list[str], list[list[str]]]:
    """`make bench` section: the full run, on CUDA only."""
    if not torch.cuda.is_available():
        raise SkipSection("no CUDA device")
    return run(parse_args([]))


def main() -> None:
    from bench.run import format_table

    args = parse_args()
    if args.no_pdl:
        from worker.backends import pdl

        pdl.enabled = False
    if args.quantization and not over_ranks(args):
        from bench.quant_bench import run_quantized, table_rows

        print(format_table(*table_rows(run_quantized(args))))
        return
    header, rows = table_from_json(args.table_from) if args.table_from else run(args)
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
