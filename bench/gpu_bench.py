"""The executor on CUDA (torch backend) against transformers' continuous batching
(`generate_batch`) and the roofline, on a Llama-3.1-8B-shaped model with random bf16
weights made on the GPU and shared by both engines (no second copy).

Workloads: fixed prompt / output lengths, EOS ignored. Offline throughput (all
requests enqueued at once) in output tokens/s; TTFT and time per output token
(TPOT) for one request alone. The roofline comes from the HBM bandwidth (a large
device-to-device copy, bytes read + written) and bf16 GEMM FLOP/s (8192^3 on random
data) measured in the same run.

    python -m bench.gpu_bench                 # everything (about 8 minutes on an H100)
    python -m bench.gpu_bench --skip-hf       # tokenwire only
    python -m bench.gpu_bench --tiny --device cpu   # a smoke run of the code paths

Needs only torch, triton, numpy, safetensors, tokenizers and transformers.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import gc
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from bench import SkipSection
from bench.host_timing import HostTimer, summarize

TITLE = "GPU: tokenwire (torch backend) vs transformers generate_batch, Llama-3.1-8B shape, random bf16"

LLAMA_8B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": None,
}
TINY = {**LLAMA_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096, "bos_token_id": 1,
        "rope_scaling": {**LLAMA_8B["rope_scaling"], "original_max_position_embeddings": 1024}}  # fmt: skip

# (prompt, output, requests for tokenwire, requests for transformers)
# transformers gets fewer requests: it runs at a few hundred tokens/s here (see the table).
WORKLOADS = [(128, 128, 1024, 32), (128, 2048, 256, 16), (2048, 128, 256, 32), (1000, 1000, 256, 16)]
TINY_WORKLOADS = [(16, 16, 8, 4), (16, 64, 4, 2), (64, 8, 4, 2)]


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


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the roofline -------------------------------------------------------------------------


def measure_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 4 GiB device-to-device copy, counting bytes read plus bytes written."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / float(np.median(times))


# Seconds of back-to-back products for a sustained rate (its second half is timed).
SUSTAINED_S = 6.0


def product_rate(product: Callable[[], object], flop: float, device: torch.device, sustained_s: float = 0.0) -> float:
    """FLOP/s of `product` (`flop` a call): over 20 calls after 3 of warm-up, or, with
    `sustained_s`, over the second half of that many seconds of calls back to back. An H100
    SXM runs the first tens of ms of dense GEMMs at its boost clock; then its 700 W cap
    holds the SM clock at 1.35-1.5 GHz: 8192^3 bf16 at 791-800 TFLOP/s in 20 calls, ~675
    sustained; FP8 1434 against ~1178 (bench/results/power_cap_h100_2026-11-28_s19.txt)."""
    for _ in range(3):
        product()
    sync(device)
    if not sustained_s:
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            product()
        sync(device)
        return flop * reps / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    calls, timed_from = 0, None
    while (now := time.perf_counter()) - t0 < sustained_s:
        if timed_from is None and now - t0 >= sustained_s / 2:
            calls, timed_from = 0, now
        for _ in range(4):
            product()
        calls += 4
        sync(device)
    assert timed_from is not None
    return flop * calls / (time.perf_counter() - timed_from)


def sustained_note(sustained_flops: float) -> str:
    """`; N sustained, ...` for a log line, or nothing when the rate was not measured (nan)."""
    if math.isnan(sustained_flops):
        return ""
    return f"; {sustained_flops / 1e12:.0f} sustained, the last {SUSTAINED_S / 2:.0f} s of {SUSTAINED_S:.0f}"


def measure_gemm(device: torch.device, sustained_s: float = 0.0) -> float:
    """bf16 FLOP/s of an 8192^3 matrix product on random data (product_rate)."""
    n = 8192 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return product_rate(lambda: a @ b, 2 * n**3, device, sustained_s)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(slots=True)
class Roofline:
    bandwidth: float  # bytes/s
    flops: float  # FLOP/s
    weight_bytes: int  # read once per step
    matmul_params: int  # per token, lm_head excluded
    lm_head_params: int
    kv_bytes_per_token: int
    attn_flops_per_ctx: int  # per query token per key
    # Pipeline stages: one sequence's step runs them one after the other, each reading its
    # share of the bytes at one stage's bandwidth (a batch's micro-batches overlap them).
    stages: int = 1
    # FLOP/s the GPU holds under minutes of load (product_rate's sustained rate); nan: not
    # measured. The roofline's figures use `flops`; `at_sustained` the same at this rate.
    sustained_flops: float = math.nan

    def at_sustained(self) -> Roofline | None:
        return None if math.isnan(self.sustained_flops) else replace(self, flops=self.sustained_flops)

    def step_floor(self, tokens: int, sampled: int, ctx_sum: float, kv_read_tokens: float) -> float:
        """Seconds: the larger of compute and memory time for one step."""
        flops: float = 2 * self.matmul_params * tokens + 2 * self.lm_head_params * sampled
        flops += self.attn_flops_per_ctx * ctx_sum
        memory = self.weight_bytes + self.kv_bytes_per_token * kv_read_tokens
        return max(flops / self.flops, memory / self.bandwidth)

    def decode_floor(self, context: int) -> float:
        """Seconds per token for one sequence alone: weights plus its KV, read once."""
        return (self.weight_bytes + self.kv_bytes_per_token * context) / self.bandwidth * self.stages

    def offline_tok_s(self, prompt: int, output: int, requests: int, batch: int) -> float:
        """Best output tokens/s: prefill at full compute, then waves of at most `batch`
        concurrent sequences decoding, each step reading all weights and the wave's KV."""
        prefill = self.step_floor(prompt * requests, requests, requests * prompt * prompt / 2, 0)
        full, rest = divmod(requests, min(batch, requests))

        def wave(n: int) -> float:
            return sum(self.step_floor(n, n, n * (prompt + i), n * (prompt + i)) for i in range(output - 1))

        decode = full * wave(min(batch, requests)) + (wave(rest) if rest else 0.0)
        return requests * output / (prefill + decode)

    def max_utilization_tok_s(self, prompt: int, output: int, requests: int, batch: int, kv_tokens: int) -> float:
        """Best output tokens/s under MAX_UTILIZATION: step by step, the oldest waiting sequences
        admitted while the cache holds their tokens now (at most `batch` running), the newest
        running one dropped when the next step's tokens do not fit, and recomputed (prompt and
        generated tokens) when admitted again; each step at its floor, block rounding ignored."""
        waiting = [(i, 0) for i in range(requests)]  # (arrival, tokens generated), oldest first
        running: list[list[int]] = []  # [arrival, tokens in the cache, tokens generated]
        seconds, done = 0.0, 0
        while done < requests:
            read = sum(s[1] + 1 for s in running)  # each decodes one token this step, over its cache
            held = read
            admitted: list[list[int]] = []
            while waiting and len(running) + len(admitted) < batch:
                arrival, generated = waiting[0]
                if held + prompt + generated > kv_tokens:
                    break
                waiting.pop(0)
                admitted.append([arrival, prompt + generated, generated + 1])  # its prefill samples a token
                held += prompt + generated
            if not running and not admitted:
                raise ValueError(f"a request's {prompt + waiting[0][1]} tokens do not fit a {kv_tokens}-token cache")
            computed = sum(s[1] for s in admitted)
            seconds += self.step_floor(len(running) + computed, len(running) + len(admitted),
                                       read + sum(s[1] ** 2 / 2 for s in admitted), read)  # fmt: skip
            for s in running:
                s[1] += 1
                s[2] += 1
            running = sorted(running + admitted)
            done += sum(1 for s in running if s[2] == output)
            running = [s for s in running if s[2] < output]
            while running and sum(s[1] + 1 for s in running) > kv_tokens:
                arrival, _, generated = running.pop()  # the newest
                bisect.insort(waiting, (arrival, generated))
        return requests * output / seconds

    def for_schedule(self, prompt: int, output: int, requests: int, max_batch: int, kv_tokens: int,
                     policy: str) -> float:  # fmt: skip
        """Best output tokens/s of an offline workload under the capacity scheduler `policy`."""
        if policy == "max_utilization":
            return self.max_utilization_tok_s(prompt, output, requests, max_batch, kv_tokens)
        # GUARANTEED_NO_EVICT: as many at once as the cache holds at full length
        return self.offline_tok_s(prompt, output, requests, min(max_batch, requests, kv_tokens // (prompt + output)))


def roofline_for(cfg: Any, bandwidth: float, flops: float, dtype_bytes: int, stages: int = 1,
                 kv_bytes: int | None = None) -> Roofline:  # fmt: skip
    """`dtype_bytes` a weight, and a KV value unless `kv_bytes` says otherwise (an FP8 cache)."""
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size
    matmul = cfg.num_layers * per_layer
    lm_head = cfg.vocab_size * h
    return Roofline(
        bandwidth=bandwidth,
        flops=flops,
        weight_bytes=(matmul + lm_head) * dtype_bytes,
        matmul_params=matmul,
        lm_head_params=lm_head,
        kv_bytes_per_token=2 * cfg.num_layers * cfg.num_kv_heads * d * (kv_bytes or dtype_bytes),
        attn_flops_per_ctx=4 * cfg.num_layers * cfg.num_heads * d,
        stages=stages,
    )


# -- the model, shared -------------------------------------------------------------------------


def random_weights(cfg: Any, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fused projections as our backend wants them; transformers gets views into them."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device, dtype=dtype, generator=gen) * 0.02).contiguous()

    h, d = cfg.hidden_size, cfg.head_dim
    w = {
        "model.embed_tokens.weight": rand(cfg.vocab_size, h),
        "model.norm.weight": torch.ones(h, device=device, dtype=dtype),
        "lm_head.weight": rand(cfg.vocab_size, h),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        w[p + "self_attn.qkv_proj.weight"] = rand((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, cfg.num_heads * d)
        w[p + "mlp.gate_up_proj.weight"] = rand(2 * cfg.intermediate_size, h)
        w[p + "mlp.down_proj.weight"] = rand(h, cfg.intermediate_size)
    return w


def transformers_model(hf_cfg: dict[str, Any], cfg: Any, weights: dict[str, torch.Tensor], device: torch.device) -> Any:
    """A LlamaForCausalLM whose parameters are views of `weights` (no copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in hf_cfg.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    views: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            views[base + "q_proj.weight"] = t[:q]
            views[base + "k_proj.weight"] = t[q : q + kv]
            views[base + "v_proj.weight"] = t[q + kv :]
        elif name.endswith("gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            views[base + "gate_proj.weight"] = t[:inter]
            views[base + "up_proj.weight"] = t[inter:]
        else:
            views[name] = t
    for name, t in views.items():
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(t, requires_grad=False))
    rotary = model.model.rotary_emb
    with torch.device(device):  # its inv_freq buffers were made on the meta device too
        model.model.rotary_emb = type(rotary)(config)
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if left:
        raise RuntimeError(f"transformers model: tensors left on the meta device: {left[:5]}")
    return model.eval()


# -- tokenwire through the executor --------------------------------------------------------------


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab - 10, (n, length)).tolist()


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


def device_is_cuda(backend: Any) -> bool:
    return getattr(getattr(backend, "device", None), "type", None) == "cuda"


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


def bench_tokenwire(args: argparse.Namespace, cfg: Any, weights: dict[str, torch.Tensor], device: torch.device,
                    workloads: list[tuple[int, int, int, int]], roof: Roofline) -> list[Row]:  # fmt: skip
    from worker.backends.torch_backend import TorchBackend

    backend = TorchBackend(cfg, device, args.dtype, weights=weights, max_num_tokens=args.max_num_tokens,
                           max_model_len=args.max_model_len, max_graph_batch=args.max_batch,
                           max_batch_size=args.max_batch, kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    rows = bench_executor(args, cfg, backend, workloads, roof)
    del backend
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def executor_config(args: argparse.Namespace, kv_cache_dtype: str | None) -> Any:
    """The executor configuration every offline workload runs under (this bench and quant_bench)."""
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


def synthetic_step(num_seqs: int, q_len: int, ctx: int, block_size: int, vocab: int) -> Any:
    """A ForwardBatch of num_seqs sequences at context ctx, each adding q_len tokens,
    on blocks 0.. in order (the executor is idle; its cache is ours to scribble on)."""
    from worker.backends.base import ForwardBatch

    per_seq = -(-ctx // block_size)
    tables = np.arange(num_seqs * per_seq, dtype=np.int64).reshape(num_seqs, per_seq)
    positions = np.tile(np.arange(ctx - q_len, ctx), num_seqs)
    seq_of = np.repeat(np.arange(num_seqs), q_len)
    slots = tables[seq_of, positions // block_size] * block_size + positions % block_size
    query_start = np.arange(0, (num_seqs + 1) * q_len, q_len, dtype=np.int64)
    return ForwardBatch(
        token_ids=np.random.default_rng(0).integers(0, vocab, num_seqs * q_len),
        positions=positions,
        query_start=query_start,
        context_lens=np.full(num_seqs, ctx, dtype=np.int64),
        block_tables=tables,
        slot_mapping=slots,
        logits_indices=query_start[1:] - 1,
    )


# Kernel breakdowns: a decode step of each workload's kind (128/128 at batch 512; 1000/1000
# at batch 128), a prefill, batch 1.
PROFILED_STEPS = [(512, 1, 192), (128, 1, 1536), (64, 128, 128), (1, 1, 2048)]


def profile_steps(backend: Any, cfg: Any, num_blocks: int, block_size: int,
                  profiled: Sequence[tuple[int, int, int]] = PROFILED_STEPS,
                  name: str = "profile") -> None:  # fmt: skip
    """Median time of single forward + greedy sample steps, straight on the backend, and
    where the GPU time goes (torch profiler) for the `profiled` (sequences, new tokens,
    context) steps, saved as $OUT/{name}_{n}x{q}_{ctx}.txt."""
    from worker.backends.base import SamplingBatch

    def greedy(n: int) -> SamplingBatch:
        return SamplingBatch(
            temperature=np.zeros(n, np.float32), top_k=np.zeros(n, np.int64), top_p=np.ones(n, np.float32),
            min_p=np.zeros(n, np.float32), uniform=np.zeros(n), ban_rows=np.zeros(0, np.int64),
            ban_tokens=np.zeros(0, np.int64),
        )  # fmt: skip

    cases = [(1, 1, 128), (1, 1, 2048), (64, 1, 1024), (256, 1, 1024), (512, 1, 192), (512, 1, 1024),
             (64, 128, 128), (4, 2048, 2048), (1, 2048, 2048)]  # fmt: skip
    for n, q, ctx in cases:
        if n * -(-ctx // block_size) > num_blocks:
            continue
        batch, sampling = synthetic_step(n, q, ctx, block_size, cfg.vocab_size), greedy(n)
        for _ in range(3):
            backend.sample(backend.forward(batch), sampling)
        times, launches = [], []
        for _ in range(10):
            t0 = time.perf_counter()
            handle = backend.launch(batch, sampling)
            launches.append(time.perf_counter() - t0)
            handle.result()
            times.append(time.perf_counter() - t0)
        # Host time to queue the step (upload, kernels or graph replay, sampling) against the
        # whole step: a launch near the step's length leaves the GPU waiting on Python.
        log(f"step: {n} seqs x {q} new tokens at context {ctx}: {np.median(times) * 1e3:.2f} ms, host launch "
            f"{np.median(launches) * 1e3:.2f} ms")  # fmt: skip
    from torch.profiler import ProfilerActivity, profile

    out = os.environ.get("OUT", "/tmp")
    for n, q, ctx in profiled:
        if n * -(-ctx // block_size) > num_blocks:
            continue
        batch, sampling = synthetic_step(n, q, ctx, block_size, cfg.vocab_size), greedy(n)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                backend.sample(backend.forward(batch), sampling)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
        with open(os.path.join(out, f"{name}_{n}x{q}_{ctx}.txt"), "w") as f:
            f.write(table)
        print(f"--- profile: {n} seqs x {q} tokens at context {ctx}, 3 steps\n{table}", flush=True)


def run_direct(backend: Any, prompts: np.ndarray, output: int, max_batch: int, max_num_tokens: int,
               block_size: int, num_blocks: int) -> tuple[float, int]:  # fmt: skip
    """The backend alone, driven by a minimal vectorised offline loop: whole prompts
    admitted while the step's token budget, the batch limit and free KV blocks allow
    (all of a request's blocks reserved up front), then one token per step for each
    running sequence. No executor: the gap to it is the executor's cost."""
    from worker.backends.base import ForwardBatch, SamplingBatch

    n, p = prompts.shape
    need = -(-(p + output) // block_size)
    tables = np.zeros((n, need), dtype=np.int64)
    free = list(range(num_blocks))
    last = np.zeros(n, dtype=np.int64)  # last sampled token
    ctx = np.zeros(n, dtype=np.int64)  # tokens in the cache
    made = np.zeros(n, dtype=np.int64)
    running = np.zeros(0, dtype=np.int64)
    waiting = 0
    zeros_f, zeros_i = np.zeros(max_batch, np.float32), np.zeros(max_batch, np.int64)
    t0 = time.perf_counter()
    while waiting < n or running.size:
        k = 0
        budget = max_num_tokens - running.size
        while (waiting + k < n and running.size + k < max_batch and (k + 1) * p <= budget
               and len(free) >= (k + 1) * need):  # fmt: skip
            k += 1
        new = np.arange(waiting, waiting + k)
        for i in new:
            tables[i] = [free.pop() for _ in range(need)]
        waiting += k
        rows = np.concatenate([running, new])
        q_len = np.concatenate([np.ones(running.size, np.int64), np.full(k, p)])
        query_start = np.concatenate([[0], np.cumsum(q_len)])
        seq_of = np.repeat(np.arange(rows.size), q_len)
        offset = np.arange(int(query_start[-1])) - query_start[:-1][seq_of]
        positions = ctx[rows][seq_of] + offset
        tokens = np.concatenate([last[running], prompts[new].ravel()])
        slots = tables[rows[seq_of], positions // block_size] * block_size + positions % block_size
        batch = ForwardBatch(token_ids=tokens, positions=positions, query_start=query_start,
                             context_lens=ctx[rows] + q_len, block_tables=tables[rows], slot_mapping=slots,
                             logits_indices=query_start[1:] - 1)  # fmt: skip
        b = rows.size
        sampling = SamplingBatch(temperature=zeros_f[:b], top_k=zeros_i[:b], top_p=zeros_f[:b] + 1,
                                 min_p=zeros_f[:b], uniform=np.zeros(b), ban_rows=zeros_i[:0],
                                 ban_tokens=zeros_i[:0])  # fmt: skip
        out = backend.sample(backend.forward(batch), sampling)
        last[rows] = out.token_ids
        ctx[rows] += q_len
        made[rows] += 1
        done = rows[made[rows] >= output]
        for i in done:
            free.extend(tables[i].tolist())
        running = rows[made[rows] < output]
    return time.perf_counter() - t0, int(made.sum())


# -- transformers' continuous batching ----------------------------------------------------------------


def hf_offline(model: Any, inputs: list[list[int]], output: int) -> tuple[float, int, str]:
    """(seconds, output tokens, how) for transformers' continuous batching on `inputs`.

    Timed like ours: from handing over the requests to the last result, with the
    manager made and warmed up (CUDA graphs captured) beforehand. Falls back to
    timing a whole `generate_batch` call where the manager API differs."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=output, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(max_prompt_length=max(map(len, inputs)), max_generated_length=output,
                              num_requests=len(inputs))  # fmt: skip
        manager = model.init_continuous_batching(generation_config=gen, workload_hints=hints)
    except (ImportError, TypeError, AttributeError):
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=inputs, generation_config=gen)
        seconds = time.perf_counter() - t0
        return seconds, sum(len(r.generated_tokens or []) for r in out.values()), "generate_batch (setup timed)"
    if hasattr(manager, "warmup"):
        manager.warmup()
    manager.start()
    try:
        t0 = time.perf_counter()
        ids = manager.add_requests(inputs=inputs, max_new_tokens=output)
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped")
        seconds = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=10)
        if hasattr(manager, "destroy"):
            manager.destroy()
    return seconds, sum(len(r.generated_tokens or []) for r in done.values()), "continuous batching manager"


def bench_transformers(model: Any, rows: list[Row], workloads: list[tuple[int, int, int, int]], vocab: int,
                       budget_s: float, save: Any) -> None:  # fmt: skip
    start = time.perf_counter()
    # Cheapest first, so a spent time budget skips the longest run.
    order = sorted(zip(rows, workloads, strict=True), key=lambda rw: (rw[1][1] * rw[1][3], rw[1][0]))
    for row, (prompt, output, _, n) in order:
        if time.perf_counter() - start > budget_s:
            row.hf_error = "not run (time budget)"
            continue
        try:
            row.hf_seconds, row.hf_output_tokens, how = hf_offline(model, prompts_for(n, prompt, vocab, 1), output)
        except Exception as e:  # report what transformers could not do, keep the table
            row.hf_error = f"{type(e).__name__}: {str(e)[:120]}"
            log(f"transformers {row.workload}: failed: {row.hf_error}")
            continue
        row.hf_requests = n
        log(f"transformers {row.workload}: {row.hf_tok_s:,.0f} tok/s ({row.hf_output_tokens} tokens "
            f"of {n * output}; {how})")  # fmt: skip
        save()
        gc.collect()
        torch.cuda.empty_cache()


# -- the table ---------------------------------------------------------------------------------------------


def format_rows(rows: list[Row], roof: Roofline) -> tuple[list[str], list[list[str]]]:
    header = ["workload", "reqs", "tokenwire tok/s", "HF reqs", "HF CB tok/s", "vs HF", "roofline tok/s",
              "of roofline", "at sustained GEMM rate (of it)", "mean batch", "backend alone tok/s", "TTFT b1 ms",
              "TPOT b1 ms", "TPOT floor ms", "TPOT/floor"]  # fmt: skip
    profiled = any("host_ms" in r.extra for r in rows)
    if profiled:  # --profile: is the host on the critical path?
        header += ["step ms", "host ms/step", "GPU wait ms/step", "steps host-bound"]
    out = []
    for r in rows:
        floor_ms = r.extra.get("tpot_floor_ms", roof.decode_floor(0) * 1e3)
        out.append([
            r.workload, str(r.requests), f"{r.tok_s:,.0f}",
            str(r.hf_requests) if r.hf_requests else "-",
            f"{r.hf_tok_s:,.0f}" if r.hf_output_tokens else (r.hf_error or "-"),
            f"{r.tok_s / r.hf_tok_s:.1f}x" if r.hf_output_tokens else "-",
            f"{r.roofline_tok_s:,.0f}", f"{r.tok_s / r.roofline_tok_s:.0%}",
            f"{sustained:,.0f} ({r.tok_s / sustained:.0%})" if (sustained := r.extra.get("sustained_roofline_tok_s"))
            else "-",
            f"{r.mean_batch:.0f}",
            f"{r.extra['direct_tok_s']:,.0f}" if "direct_tok_s" in r.extra else "-",
            f"{r.ttft_ms:.1f}", f"{r.tpot_ms:.2f}", f"{floor_ms:.2f}", f"{r.tpot_ms / floor_ms:.2f}",
        ])  # fmt: skip
        if profiled:
            e = r.extra
            out[-1] += ([f"{e['step_ms']:.2f}", f"{e['host_ms']:.2f}", f"{e['gpu_wait_ms']:.2f}",
                         f"{e['host_bound_steps']:.0%}"] if "host_ms" in e else ["-"] * 4)  # fmt: skip
    return header, out


def environment(device: torch.device) -> dict[str, str]:
    import transformers

    env = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "absent"
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = str(torch.version.cuda)
    return env


def run(args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    from worker.models.config import ModelConfig

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SkipSection("no CUDA device")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    hf_cfg = TINY if args.tiny else LLAMA_8B
    if args.model_shape != "8b" and not args.tiny:
        from bench.tp_bench import SHAPES

        hf_cfg = SHAPES[args.model_shape]
    workloads = TINY_WORKLOADS if args.tiny else WORKLOADS
    if args.workloads:
        keep = set(args.workloads.split(","))
        workloads = [w for w in workloads if f"{w[0]}/{w[1]}" in keep]
    if args.scale != 1.0:
        workloads = [(p, o, max(1, int(n * args.scale)), max(1, int(m * args.scale))) for p, o, n, m in workloads]
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
        from bench.quant_bench import roofline_of

        bandwidth, flops = measure_bandwidth(device), measure_gemm(device)
        roof = roofline_of(cfg, None, dtype.itemsize, bandwidth, flops, kv_cache_dtype=args.kv_cache_dtype)
        if device.type == "cuda":
            roof.sustained_flops = measure_gemm(device, SUSTAINED_S)
        floor_ms = roof.weight_bytes / bandwidth * 1e3
        log(f"roofline: {bandwidth / 1e12:.2f} TB/s, {flops / 1e12:.0f} TFLOP/s{sustained_note(roof.sustained_flops)}; "
            f"weights {roof.weight_bytes / 1e9:.2f} GB -> batch-1 TPOT floor {floor_ms:.2f} ms")  # fmt: skip
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
            "model_shape": "tiny" if args.tiny else args.model_shape,
            "tensor_parallel_size": args.tensor_parallel_size,
            "pipeline_parallel_size": args.pipeline_parallel_size,
            "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype,
            "scheduler_policy": args.scheduler_policy,
            "dtype": args.dtype,
            "rows": [asdict(r) | {"tok_s": r.tok_s, "hf_tok_s": r.hf_tok_s} for r in rows],
        }
        out = os.environ.get("OUT")
        if out:
            split = f"tp{args.tensor_parallel_size}" + (f"_pp{pp}" if (pp := args.pipeline_parallel_size) > 1 else "")
            quant = f"_{args.quantization}" if args.quantization else ""
            shape = "tiny" if args.tiny else args.model_shape
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
          f"{args.quantization or args.dtype} weights {roof.weight_bytes / 1e9:.2f} GB read per step")  # fmt: skip
    return header, table


def table_from_json(path: str) -> tuple[list[str], list[list[str]]]:
    """Re-render a saved run's table (the roofline recomputed from its measured ceilings)."""
    from bench.quant_bench import roofline_of
    from bench.tp_bench import SHAPES
    from worker.models.config import ModelConfig

    with open(path) as f:
        saved = json.load(f)
    shape = saved.get("model_shape", "8b")
    cfg = ModelConfig.from_hf(TINY if shape == "tiny" else SHAPES[shape])
    dtype_bytes = 4 if saved.get("dtype") == "float32" else 2  # runs saved before it was recorded ran bf16
    roof = roofline_of(cfg, saved.get("quantization"), dtype_bytes, saved["bandwidth_TBps"] * 1e12,
                       saved["gemm_TFLOPps"] * 1e12, saved.get("pipeline_parallel_size", 1),
                       saved.get("kv_cache_dtype"))  # fmt: skip
    fields = set(Row.__dataclass_fields__)
    rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in saved["rows"]]
    for row in rows:
        prompt, output = (int(x) for x in row.workload.split("/"))
        # Runs saved before kv_tokens was recorded: the H100's 13773 blocks of 32 tokens.
        kv_tokens = int(row.extra.get("kv_tokens", 13773 * 32))
        n = row.requests
        max_batch = int(row.extra.get("max_batch", 512))  # runs saved before it was recorded ran at 512
        row.roofline_tok_s = roof.for_schedule(prompt, output, n, max_batch, kv_tokens,
                                               saved.get("scheduler_policy", "guaranteed_no_evict"))  # fmt: skip
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
    p.add_argument("--scale", type=float, default=1.0, help="multiply every request count")
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--scheduler-policy", default="guaranteed_no_evict",
                   choices=["guaranteed_no_evict", "max_utilization"],
                   help="the capacity scheduler policy (TensorRT-LLM's default, or admit on current length "
                        "and preempt by recompute); the roofline is that policy's schedule at the floor")  # fmt: skip
    p.add_argument("--free-memory-fraction", type=float, default=0.9,
                   help="of the device memory free after the weights and working memory, what the KV cache takes "
                        "(TensorRT-LLM's kv_cache_free_gpu_mem_fraction: 0.9 by default, 0.95 in its published runs)")
    p.add_argument("--max-num-tokens", type=int, default=8192)
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
    p.add_argument("--model-shape", default="8b", choices=["8b", "70b"],
                   help="Llama-3.1-8B or -70B shape (70b needs enough GPUs for its shards)")
    p.add_argument("--quantization", default=None, choices=["fp8", "int4"],
                   help="quantize the model at start: on one GPU at the 8B shape bench/quant_bench.py's "
                        "workloads; over several GPUs or at the 70B shape these (bench/tp_bench.py)")  # fmt: skip
    return p


def over_ranks(args: argparse.Namespace) -> bool:
    """Whether the model runs over rank processes (bench/tp_bench.py): several GPUs, or the
    70B shape; otherwise it is the 8B shape on one GPU, in this process."""
    return args.tensor_parallel_size * args.pipeline_parallel_size > 1 or args.model_shape != "8b"


def table() -> tuple[list[str], list[list[str]]]:
    """`make bench` section: the full run, on CUDA only."""
    if not torch.cuda.is_available():
        raise SkipSection("no CUDA device")
    return run(parser().parse_args([]))


def main() -> None:
    from bench.run import format_table

    args = parser().parse_args()
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
