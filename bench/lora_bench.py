"""Many LoRA adapters in one batch, on the GPU.

1. End to end: the executor on the Llama-3.1-8B-shaped random bf16 model (bench/random_weights.py),
   128/128 offline, EOS ignored: output tok/s with the requests spread over N random rank-r
   adapters on every linear layer (q, k, v, o, gate, up, down; request i runs adapter i mod N)
   against no adapters, in the same run: the plain executor (LoRA off), then one with the
   adapters registered, its requests without adapter and with them taking turns. Goal: the
   adapters' throughput >= 0.80 of the plain executor's. The adapters are written to a temp
   directory in the Hugging Face PEFT format by hand (peft is not on the GPU host): random
   normal A and B, scaled small.
2. The kernel alone: `add_lora` on each projection of the model (fused qkv, o, fused gate_up,
   down; rank r per part, N slots) at T = 1, 64, 512, 8192 tokens against the base GEMM of
   the same shape (torch.matmul), both replayed from CUDA graphs: the per-layer overhead;
   and with one `plan_lora` per step shared by the calls (the layer row counts the plan
   once). Up to 512 tokens each token has its own random slot (decode); 8192 tokens come in
   runs of 128 of one slot (prefill chunks of 128-token prompts).

    python -m bench.lora_bench                      # both, one H100 (about 5 minutes)
    python -m bench.lora_bench --skip-e2e           # the kernel table only
    python -m bench.lora_bench --tiny --device cpu  # a smoke run of the code paths

Needs only torch, triton, numpy and safetensors.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import SkipSection, log
from bench.device_rates import sync
from bench.environment import environment
from bench.model_shapes import LLAMA_8B, TINY
from bench.random_weights import random_weights
from bench.runner import iteration_summary, mean_decode_batch, run_requests_offline
from bench.workloads import prompts_for

TITLE = "LoRA: 16 random rank-16 adapters on every linear layer vs none, 8B shape, 128/128, one GPU"
GOAL = 0.80  # adapters' tok/s over the plain executor's
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# -- adapters in the PEFT format ----------------------------------------------------------------


def projection_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of each LoRA target module."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip


def write_peft_adapter(directory: Path, cfg: Any, rank: int, seed: int, device: torch.device) -> None:
    """adapter_config.json + adapter_model.safetensors as PEFT saves a LoRA of a Llama model:
    A [r, in] and B [out, r] per target module, bf16, alpha = 2r."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "random-llama-8b-shape",
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": list(TARGETS), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None, "rank_pattern": {},
        "alpha_pattern": {}, "inference_mode": True,
    }  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for module, (n_in, n_out) in projection_shapes(cfg).items():
            part = "self_attn" if module in TARGETS[:4] else "mlp"
            name = f"base_model.model.model.layers.{i}.{part}.{module}"
            for kind, shape in (("lora_A", (rank, n_in)), ("lora_B", (n_out, rank))):
                w = torch.randn(shape, generator=gen, device=device) / shape[1] ** 0.5 * 0.1
                tensors[f"{name}.{kind}.weight"] = w.to(torch.bfloat16).cpu()
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})


# -- end to end ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    name: str
    requests: int
    seconds: float
    output_tokens: int
    mean_batch: float
    iterations: dict[str, float]

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def requests_for(prompts: list[list[int]], output: int, adapters: list[str]) -> list[Any]:
    """One request per prompt; request i under adapters[i % len(adapters)], or none."""
    from worker.executor import LoraConfig, Request

    return [Request(input_token_ids=p, max_tokens=output, end_id=-1,
                    lora_config=LoraConfig(adapters[i % len(adapters)]) if adapters else None)
            for i, p in enumerate(prompts)]  # fmt: skip


def start_executor(args: argparse.Namespace, cfg: Any, weights: dict[str, torch.Tensor], device: torch.device,
                   adapters: dict[str, str]) -> Any:  # fmt: skip
    from worker.backends.torch_backend import TorchBackend
    from worker.executor import EngineCore, Executor, ExecutorConfig, KvCacheConfig, PeftCacheConfig

    t0 = time.perf_counter()
    backend = TorchBackend(cfg, device, args.dtype, weights=weights, max_num_tokens=args.max_num_tokens,
                           max_model_len=args.max_model_len, max_graph_batch=args.max_batch,
                           max_batch_size=args.max_batch)  # fmt: skip
    config = ExecutorConfig(
        max_batch_size=args.max_batch,
        max_num_tokens=args.max_num_tokens,
        kv_cache_config=KvCacheConfig(tokens_per_block=args.block_size, free_memory_fraction=0.9,
                                      enable_block_reuse=False),
        iteration_stats_max=1_000_000,
        lora_adapters=adapters,
        peft_cache_config=PeftCacheConfig(max_device_adapters=len(adapters), max_rank=args.rank) if adapters else None,
    )  # fmt: skip
    executor = Executor(EngineCore(backend, config))
    log(f"executor ({len(adapters)} adapters) up in {time.perf_counter() - t0:.1f} s: "
        f"{executor.core.blocks.num_blocks} KV blocks of {args.block_size}")  # fmt: skip
    return executor


def measure(executor: Any, name: str, prompts: list[list[int]], output: int, adapters: list[str]) -> Run:
    executor.get_latest_iteration_stats()  # drains: what follows is this run's alone
    seconds, tokens = run_requests_offline(executor, requests_for(prompts, output, adapters))
    if tokens != len(prompts) * output:
        raise RuntimeError(f"{name}: {tokens} output tokens, expected {len(prompts) * output}")
    stats = executor.get_latest_iteration_stats()
    run = Run(name, len(prompts), seconds, tokens, mean_decode_batch(stats), iteration_summary(stats))
    log(f"{name}: {run.tok_s:,.0f} tok/s (mean decode batch {run.mean_batch:.0f}); iterations {run.iterations}")
    return run


def bench_e2e(args: argparse.Namespace, cfg: Any, weights: dict[str, torch.Tensor], device: torch.device,
              adapter_root: Path) -> list[Run]:  # fmt: skip
    prompt, output = args.workload
    prompts = prompts_for(args.requests, prompt, cfg.vocab_size, 1)
    warm = prompts_for(2 * args.adapters, 64, cfg.vocab_size, 99)
    t0 = time.perf_counter()
    names = [f"adapter{k:02d}" for k in range(args.adapters)]
    for k, name in enumerate(names):
        write_peft_adapter(adapter_root / name, cfg, args.rank, seed=1000 + k, device=device)
    log(f"{args.adapters} PEFT adapters of rank {args.rank} written in {time.perf_counter() - t0:.1f} s")

    runs: list[Run] = []
    plain = start_executor(args, cfg, weights, device, {})
    run_requests_offline(plain, requests_for(warm, 8, []))  # warm-up: Triton compiles for prefill shapes
    best_plain = min((measure(plain, "no LoRA (plain executor)", prompts, output, [])
                      for _ in range(args.repeats)), key=lambda r: r.seconds)  # fmt: skip
    runs.append(best_plain)
    plain.shutdown()
    del plain
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    executor = start_executor(args, cfg, weights, device, {n: str(adapter_root / n) for n in names})
    # Warm-up: every adapter to the device, and the kernels compiled, before anything is timed.
    run_requests_offline(executor, requests_for(warm, 8, names) + requests_for(warm[:4], 8, []))
    taken: dict[str, list[Run]] = {"none": [], "adapters": []}
    for _ in range(args.repeats):  # taking turns, so that drift hits both alike
        taken["none"].append(measure(executor, "LoRA on, requests without adapter", prompts, output, []))
        taken["adapters"].append(measure(executor, f"{args.adapters} adapters x rank {args.rank}", prompts, output,
                                         names))  # fmt: skip
    executor.shutdown()
    runs += [min(taken["none"], key=lambda r: r.seconds), min(taken["adapters"], key=lambda r: r.seconds)]
    return runs


# -- the kernel alone -------------------------------------------------------------------------------


def time_us(fn: Callable[[], object], device: torch.device, reps: int = 20) -> float:
    """Microseconds per call: `reps` calls captured in one CUDA graph, replayed (no launch
    cost, as in the engine's decode graphs); on the CPU, plain calls."""
    if device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()  # compiles, picks cuBLAS kernels
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return float(np.median(times))


def fused_projections(cfg: Any, rank: int) -> dict[str, tuple[int, int, int]]:
    """(in, out, R) of each projection as the backend runs it: qkv and gate_up fused, their
    parts' ranks stacked."""
    shapes = projection_shapes(cfg)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv_out = shapes["q_proj"][1] + 2 * shapes["k_proj"][1]
    return {"qkv": (h, qkv_out, 3 * rank), "o": (*shapes["o_proj"], rank), "gate_up": (h, 2 * inter, 2 * rank),
            "down": (inter, h, rank)}  # fmt: skip


def bench_kernel(args: argparse.Namespace, cfg: Any, device: torch.device) -> list[list[str]]:
    from worker.backends.lora_kernel import add_lora, plan_lora

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for t in args.kernel_tokens:
        if t <= 512:
            slots = torch.randint(0, args.adapters, (t,), generator=gen, device=device)
            how = "per token"
        else:
            slots = torch.randint(0, args.adapters, (-(-t // 128),), generator=gen, device=device)
            slots = slots.repeat_interleave(128)[:t]
            how = "runs of 128"
        # The step's plan, made once (None where the batch is small enough to scan).
        plan = plan_lora(slots, args.adapters) if device.type == "cuda" else None
        plan_us = time_us(functools.partial(plan_lora, slots, args.adapters), device) if plan is not None else 0.0
        base_sum = lora_sum = shared_sum = 0.0
        for name, (n_in, n_out, rank) in fused_projections(cfg, args.rank).items():
            x = torch.randn(t, n_in, generator=gen, device=device).to(dtype)
            w = (torch.randn(n_out, n_in, generator=gen, device=device) * 0.02).to(dtype)
            a = (torch.randn(args.adapters, rank, n_in, generator=gen, device=device) * 0.02).to(dtype)
            b = (torch.randn(args.adapters, n_out, rank, generator=gen, device=device) * 0.02).to(dtype)
            y = torch.empty(t, n_out, device=device, dtype=dtype)
            base = time_us(functools.partial(torch.matmul, x, w.t(), out=y), device)
            lora = time_us(functools.partial(add_lora, y, x, a, b, slots), device)
            shared = time_us(functools.partial(add_lora, y, x, a, b, slots, plan=plan), device)
            base_sum, lora_sum, shared_sum = base_sum + base, lora_sum + lora, shared_sum + shared
            rows.append([str(t), how, name, f"{n_in}->{n_out}", str(rank), f"{base:,.1f}", f"{lora:,.1f}",
                         f"{lora / base:.1%}", f"{shared:,.1f}"])  # fmt: skip
            del x, w, a, b, y
        shared_sum += plan_us
        rows.append([str(t), how, "layer (4 above)", "", "", f"{base_sum:,.1f}", f"{lora_sum:,.1f}",
                     f"{lora_sum / base_sum:.1%}", f"{shared_sum:,.1f} ({shared_sum / base_sum:.1%})"])  # fmt: skip
        log(f"kernel T={t}: layer base {base_sum:.1f} us, add_lora {lora_sum:.1f} us, "
            f"one plan shared {shared_sum:.1f} us (the plan {plan_us:.1f})")  # fmt: skip
    return rows


KERNEL_HEADER = ["T", "slots", "projection", "in->out", "R", "base GEMM us", "add_lora us", "overhead",
                 "plan shared us"]  # fmt: skip


def e2e_table(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    header = ["run", "reqs", "tok/s", "vs plain", "mean batch", "gen iters", "gen ms", "ctx iters", "ctx ms"]
    plain = runs[0].tok_s
    rows = [[r.name, str(r.requests), f"{r.tok_s:,.0f}", f"{r.tok_s / plain:.3f}", f"{r.mean_batch:.0f}",
             str(r.iterations["gen_iters"]), str(r.iterations["gen_ms"]), str(r.iterations["ctx_iters"]),
             str(r.iterations["ctx_ms"])] for r in runs]  # fmt: skip
    return header, rows


def run(args: argparse.Namespace) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) per section."""
    from worker.models.config import ModelConfig

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SkipSection("no CUDA device")
    cfg = ModelConfig.from_hf(TINY if args.tiny else LLAMA_8B)
    env = environment(device)
    log("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    tables = []
    summary: dict[str, Any] = {"environment": env, "adapters": args.adapters, "rank": args.rank}
    if not args.skip_kernel:
        rows = bench_kernel(args, cfg, device)
        summary["kernel"] = [dict(zip(KERNEL_HEADER, r, strict=True)) for r in rows]
        tables.append(("add_lora alone vs the base GEMM, CUDA-graph replays", KERNEL_HEADER, rows))
    if not args.skip_e2e:
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        weights = random_weights(cfg, device, dtype)
        sync(device)
        with tempfile.TemporaryDirectory(prefix="tokenwire-lora-bench-") as root:
            runs = bench_e2e(args, cfg, weights, device, Path(root))
        ratio = runs[-1].tok_s / runs[0].tok_s
        summary["e2e"] = [asdict(r) | {"tok_s": r.tok_s} for r in runs]
        summary["ratio"] = ratio
        prompt, output = args.workload
        title = (f"executor, {prompt}/{output} x {args.requests}: {args.adapters} adapters / plain = {ratio:.3f} "
                 f"(goal >= {GOAL:.2f}: {'met' if ratio >= GOAL else 'NOT met'})")  # fmt: skip
        tables.append((title, *e2e_table(runs)))
    out = os.environ.get("OUT")
    if out:  # named for what ran, so that the sections run apart keep both files
        name = "lora_bench" + ("_kernel" if args.skip_e2e else "") + ("_e2e" if args.skip_kernel else "")
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return tables


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tiny", action="store_true", help="a tiny model and few requests: the code paths, not the speed")
    p.add_argument("--skip-e2e", action="store_true", help="only the kernel table")
    p.add_argument("--skip-kernel", action="store_true", help="only the executor table")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=None, help="requests per run (default 1024; tiny 16)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each kind (best counts)")
    p.add_argument("--kernel-tokens", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="token counts of the kernel table (default 1,64,512,8192; tiny 1,8,100)")  # fmt: skip
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=32)
    return p


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    args.workload = (16, 16) if args.tiny else (128, 128)
    if args.requests is None:
        args.requests = 16 if args.tiny else 1024
    if args.kernel_tokens is None:
        args.kernel_tokens = [1, 8, 100] if args.tiny else [1, 64, 512, 8192]
    if args.tiny:
        args.max_batch, args.max_num_tokens, args.max_model_len = min(args.max_batch, 8), 256, 256
    return args


def table() -> tuple[list[str], list[list[str]]]:
    """`make bench` section: the executor table, on CUDA only (the kernel table: run the module)."""
    if not torch.cuda.is_available():
        raise SkipSection("no CUDA device")
    args = _defaults(parser().parse_args(["--skip-kernel"]))
    _, header, rows = run(args)[0]
    return header, rows


def main() -> None:
    from bench.run import format_table

    args = _defaults(parser().parse_args())
    for title, header, rows in run(args):
        print(f"\n== {title}")
        print(format_table(header, rows))


if __name__ == "__main__":
    main()
