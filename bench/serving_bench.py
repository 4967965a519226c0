"""Serving mode: requests arriving one by one as a Poisson process, as users see a
service (vLLM's `benchmark_serving` reports the same figures).

For each arrival rate: N requests of P prompt / O output tokens (greedy, EOS held
off with min_tokens), sent at exponentially spaced times (fixed seed) and streamed;
per request the time to first token (TTFT, from its send time), the inter-token
latencies (ITL; a message carrying k tokens counts as k gaps of a k-th of its wait)
and the end-to-end latency (E2E, send to last token); output tokens/s over the
whole run, first send to last token. The rates are fractions of the saturation
rate, measured first by sending all N requests at once ("burst"): the requests/s
that run reached. An unreported burst and lowest-rate run go before it (`sweep`).

Two paths on the same model and rates: in process (an Executor here, streamed
responses read from its await loop) and through the service (one worker process,
one gateway process, a private Redis, the ZeroMQ client here; bench/service_bench.py
starts them). Models: `default` (SmolLM2-135M, both paths), `tiny` (a 2-layer random
Llama with the default model's tokenizer, both paths: the CPU smoke run), `8b` (the
Llama-3.1-8B shape with random bf16 weights made on the GPU, in process only: the
service loads checkpoints from disk), or a checkpoint directory. `--quantization` and
`--kv-cache-dtype` run every model quantized on load (the worker's own flags on the
service path); the model column says so (`8b fp8+fp8kv`).

    python -m bench.serving_bench                               # GPU: 8b in process, then default, both paths
    python -m bench.serving_bench --model tiny --requests 24    # the CPU
    python -m bench.serving_bench --model 8b --prompt 1000 --output 100
    python -m bench.serving_bench --model 8b --quantization fp8 --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import gzip
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from bench import DEFAULT_MODEL, SkipSection, default_model, vocab_size
from bench.http_stream import stream_completion
from bench.process_cpu import own_cpu_seconds
from bench.service_stack import Stack
from bench.step_trace import PromptSteps, prompt_steps, service_iterations, unix_time
from bench.stream_timing import Timeline, pct

TITLE = "serving: Poisson arrivals at rates up to saturation, in process and through the service"
FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # of the burst's requests/s
WARM_UP = 100  # the run index (seeds) of the unreported warm-up runs; measured runs are 0 and up


@dataclass(slots=True)
class RateRun:
    model: str
    path: str
    rate: float  # requests/s asked for; inf: all at once
    first_send: float  # time.perf_counter()
    seconds: float  # first send to last token
    tokens: int
    requests: int
    ttft_ms: list[float]
    itl_ms: list[float]
    e2e_ms: list[float]
    # CPU microseconds per streamed token, by process: client, gateway, worker, engine (in
    # process: the one process, under "engine").
    cpu_us: dict[str, float] = field(default_factory=dict)
    # A burst's engine steps that processed prompts, and when the last ended (bench/step_trace.py).
    prompts: PromptSteps = field(default_factory=PromptSteps)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def row(self) -> list[str]:
        rate = "burst" if math.isinf(self.rate) else f"{self.rate:.2f}"
        return [self.model, self.path, rate, f"{self.requests / self.seconds:.2f}", f"{self.tok_s:,.0f}",
                *(f"{pct(v, q):.1f}" for v in (self.ttft_ms, self.e2e_ms) for q in (50, 99)),
                f"{pct(self.itl_ms, 50):.2f}", f"{pct(self.itl_ms, 99):.2f}",
                *(f"{self.cpu_us[p]:.1f}" if p in self.cpu_us else "-" for p in PROCESSES),
                self.prompts.cell() if self.prompts.steps else "-"]  # fmt: skip


PROCESSES = ("client", "gateway", "worker", "engine")
HEADER = ["model", "path", "rate req/s", "achieved req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
          "E2E p50 ms", "E2E p99 ms", "ITL p50 ms", "ITL p99 ms", *(f"CPU us/tok {p}" for p in PROCESSES),
          "burst: prompt steps / last ends ms / held at the first"]  # fmt: skip


def arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Send offsets in seconds of n requests arriving as a Poisson process (the first at 0)."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    # Ids clear of the special tokens at the start of a vocabulary; a new seed per run,
    # so no run is served from another's prefix cache.
    return np.random.default_rng(seed).integers(100, vocab - 10, (n, length)).tolist()


def _collect(model: str, path: str, rate: float, sent: Sequence[float], lines: list[Timeline]) -> RateRun:
    end = max(t.last for t in lines if t.last is not None)
    return RateRun(model, path, rate, min(sent), end - min(sent), sum(t.tokens for t in lines), len(lines),
                   [t.ttft * 1e3 for t in lines if t.ttft is not None], [g * 1e3 for t in lines for _, g in t.gaps],
                   [(t.last - t.start) * 1e3 for t in lines if t.last is not None])  # fmt: skip


# -- in process ----------------------------------------------------------------------------------


def run_in_process(executor: Any, model: str, prompts: list[list[int]], output: int, rate: float,
                   seed: int) -> RateRun:  # fmt: skip
    """One thread: send each request when its time comes, and meanwhile read the streamed
    responses (waiting no longer than the next send)."""
    from worker.executor import Request, SamplingConfig

    sampling = SamplingConfig(temperature=0.0, min_tokens=output)
    offsets = arrivals(len(prompts), rate, seed)
    lines: dict[int, Timeline] = {}
    sent: list[float] = []
    start = time.perf_counter()
    nxt, pending = 0, 0
    while nxt < len(prompts) or pending:
        now = time.perf_counter()
        while nxt < len(prompts) and start + offsets[nxt] <= now:
            rid = executor.enqueue_request(Request(input_token_ids=prompts[nxt], max_tokens=output, streaming=True,
                                                   sampling_config=sampling))  # fmt: skip
            lines[rid] = Timeline(now)
            sent.append(now)
            nxt, pending = nxt + 1, pending + 1
        wait = max(0.0, start + offsets[nxt] - time.perf_counter()) if nxt < len(prompts) else 60.0
        for r in executor.await_responses(timeout=wait):
            if r.has_error:
                raise RuntimeError(f"request {r.request_id}: {r.error_msg}")
            assert r.result is not None
            lines[r.request_id].add(time.perf_counter(), len(r.result.output_token_ids[0]))
            if r.result.is_final:
                pending -= 1
    return _collect(model, "in process", rate, sent, list(lines.values()))


def _in_process_at(executor: Any, model: str, n: int, prompt: int, output: int, vocab: int, rate: float,
                   i: int) -> RateRun:  # fmt: skip
    before = own_cpu_seconds()
    executor.get_latest_iteration_stats()  # the runs before this one's
    r = run_in_process(executor, model, prompts_for(n, prompt, vocab, 10 + i), output, rate, seed=i)
    r.cpu_us = {"engine": (own_cpu_seconds() - before) * 1e6 / r.tokens}
    if math.isinf(rate):
        r.prompts = prompt_steps(executor.get_latest_iteration_stats(), unix_time(r.first_send))
    return r


def _service_at(stack: Stack, endpoint: str | list[str], model: str, n: int, prompt: int, output: int, vocab: int,
                pool: ProcessPoolExecutor | None, clients: int, rate: float, i: int) -> RateRun:  # fmt: skip
    before = stack.cpu_seconds()
    r, client = service_run(endpoint, model, prompts_for(n, prompt, vocab, 20 + i), output, rate, i, pool,
                            clients)  # fmt: skip
    r.cpu_us = {"client": client * 1e6 / r.tokens,
                **{p: (s - before[p]) * 1e6 / r.tokens for p, s in stack.cpu_seconds().items()}}  # fmt: skip
    if math.isinf(rate):
        time.sleep(1.0)  # the engine's stats reach the worker's Redis thread in batches, then Redis
        first_send = unix_time(r.first_send)
        r.prompts = prompt_steps(service_iterations(stack.redis, first_send), first_send)
    return r


# -- through the service --------------------------------------------------------------------------------


async def _client_share(endpoint: str, prompts: list[list[int]], offsets: list[float], output: int,
                        start: float | None) -> list[Timeline]:  # fmt: skip
    """One client's requests, each sent at `start` + its offset (`start`: a time.perf_counter
    value, CLOCK_MONOTONIC, the same in every process of the host; None: once connected).
    `endpoint` "http://127.0.0.1:PORT/MODEL": streamed /v1/completions to that HTTP front."""
    if endpoint.startswith("http://"):
        port, model = int(endpoint.split(":")[2].split("/")[0]), endpoint.rsplit("/", 1)[1]
        await stream_completion(port, model, [100, 101, 102], 2, None, greedy=True)  # up, and the worker is ready

        def over_http(i: int, line: Timeline) -> Awaitable[None]:
            return stream_completion(port, model, prompts[i], output, line, greedy=True)

        return await _paced(offsets, time.perf_counter() if start is None else start, over_http)
    from clients.async_client import AsyncClient

    async with AsyncClient([endpoint]) as client:
        await client.generate([100, 101, 102], max_tokens=2, timeout=300)  # connected, and the worker is ready

        async def streamed(i: int, line: Timeline) -> None:
            async for chunk in client.stream(prompts[i], max_tokens=output, min_tokens=output, temperature=0.0):
                line.add(time.perf_counter(), len(chunk.token_ids))

        return await _paced(offsets, time.perf_counter() if start is None else start, streamed)


async def _paced(offsets: list[float], begin: float,
                 send: Callable[[int, Timeline], Awaitable[None]]) -> list[Timeline]:  # fmt: skip
    """Request i sent by `send(i, its timeline)` at `begin` + offsets[i], all concurrently."""
    lines: list[Timeline] = []

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, begin + offsets[i] - time.perf_counter()))
        line = Timeline(time.perf_counter())
        lines.append(line)
        await send(i, line)

    await asyncio.gather(*(one(i) for i in range(len(offsets))))
    return lines


def client_process(endpoint: str, prompts: list[list[int]], offsets: list[float], output: int,
                   start: float) -> tuple[list[Timeline], float]:  # fmt: skip
    """A client process's share of a run: its timelines and the CPU seconds it took."""
    before = own_cpu_seconds()
    lines = asyncio.run(_client_share(endpoint, prompts, offsets, output, start))
    return lines, own_cpu_seconds() - before


def service_run(endpoint: str | list[str], model: str, prompts: list[list[int]], output: int, rate: float, seed: int,
                pool: ProcessPoolExecutor | None = None, clients: int = 1) -> tuple[RateRun, float]:  # fmt: skip
    """The requests through the gateway, from this process or spread over `clients` processes
    of `pool` (request i to client i mod clients; with several gateway endpoints, client k
    to endpoint k mod their number); the run and its clients' CPU seconds."""
    endpoints = [endpoint] if isinstance(endpoint, str) else endpoint
    offsets = arrivals(len(prompts), rate, seed).tolist()
    path = "HTTP + SSE" if endpoints[0].startswith("http://") else "gateway + worker"
    if len(endpoints) > 1:
        path += f", {len(endpoints)} gateway processes"
    if pool is None:
        before = own_cpu_seconds()
        lines = asyncio.run(_client_share(endpoints[0], prompts, offsets, output, None))
        return _collect(model, path, rate, [t.start for t in lines], lines), own_cpu_seconds() - before
    n = clients
    start = time.perf_counter() + 3.0  # every client connected by then
    shares = [pool.submit(client_process, endpoints[k % len(endpoints)], prompts[k::n], offsets[k::n], output, start)
              for k in range(n)]  # fmt: skip
    lines, cpu = [], 0.0
    for share in shares:
        got, seconds = share.result()
        lines += got
        cpu += seconds
    return _collect(model, f"{path}, {n} clients", rate, [t.start for t in lines], lines), cpu


# -- models -------------------------------------------------------------------------------------------------


def tiny_checkpoint(directory: Path) -> Path:
    """A 2-layer random Llama (hidden 64) with the default model's tokenizer: real
    tokenization and detokenization on the service path, next to no model time."""
    from safetensors.numpy import save_file

    default = default_model()
    vocab = vocab_size(default)
    h, inter, layers, heads, kv_heads = 64, 128, 2, 4, 2
    d = h // heads
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": np.ones(h, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": np.ones(h, np.float32),
              p + "post_attention_layernorm.weight": np.ones(h, np.float32),
              p + "self_attn.q_proj.weight": rand(heads * d, h), p + "self_attn.k_proj.weight": rand(kv_heads * d, h),
              p + "self_attn.v_proj.weight": rand(kv_heads * d, h), p + "self_attn.o_proj.weight": rand(h, heads * d),
              p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
              p + "mlp.down_proj.weight": rand(h, inter)}  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    save_file(w, str(directory / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": h,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "float32"}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default / name, directory / name)
    return directory


def executor_config(args: argparse.Namespace) -> Any:
    from worker.executor import ExecutorConfig, KvCacheConfig

    kv = KvCacheConfig(max_tokens=args.kv_tokens or None, dtype=args.kv_cache_dtype)
    return ExecutorConfig(max_batch_size=args.max_batch, max_num_tokens=args.max_num_tokens, kv_cache_config=kv,
                          device=args.device, quantization=args.quantization)  # fmt: skip


def variant(args: argparse.Namespace) -> str:
    """How the model runs beyond its weights as stored: '' or ' fp8', ' fp8+fp8kv', ' +fp8kv'."""
    kv = "+fp8kv" if args.kv_cache_dtype else ""
    return f" {args.quantization or ''}{kv}" if args.quantization or kv else ""


def executor_8b(args: argparse.Namespace) -> tuple[Any, int]:
    """An Executor over the 8B shape with random bf16 weights on the GPU (bench/random_weights.py),
    quantized there when asked."""
    import torch

    from bench.model_shapes import LLAMA_8B
    from bench.random_weights import random_weights
    from worker.backends.torch_backend import TorchBackend
    from worker.executor import EngineCore, Executor
    from worker.models.config import ModelConfig

    if not torch.cuda.is_available():
        raise SkipSection("the 8b shape needs a CUDA device")
    cfg = ModelConfig.from_hf(LLAMA_8B)
    device = torch.device(args.device or "cuda")
    weights = random_weights(cfg, device, torch.bfloat16)
    backend = TorchBackend(cfg, device, weights=weights, max_num_tokens=args.max_num_tokens, max_model_len=4096,
                           max_graph_batch=args.max_batch, max_batch_size=args.max_batch,
                           quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    executor = Executor(EngineCore(backend, executor_config(args)))
    return executor, cfg.vocab_size


def release_device_memory() -> None:
    gc.collect()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the runs -----------------------------------------------------------------------------------------------


def sweep(run: Callable[[float, int], RateRun], rates: Sequence[float] | None, log: Callable[[str], None]) -> tuple[
        list[RateRun], list[float]]:  # fmt: skip
    """The burst first (it sets the rates when none are given), then each rate.

    Before them, unreported, a burst and a run at the lowest rate (runs WARM_UP and WARM_UP + 1:
    prompts and arrivals of their own). Triton compiles a kernel on the first launch of each
    variant, and eager steps (prefill chunks; the attention's split count follows the batch
    and its context) meet new ones for a while: on a fresh H100 the 8B's FP8 burst ran at
    14,103 tok/s and its first rate's TTFT p99 was 790 ms; on the same machine again, 18,279
    and 145 (bench/results/serving_bench_fp8_h100_2026-11-28.txt). A backend's start-up
    now runs those kernels once (TorchBackend.warm_up), yet a first burst still ran 15-20 %
    below the next (bench/results/start_up_compiles_h100_2026-11-28.txt): the warm-up
    stays until it does not."""
    warm = run(math.inf, WARM_UP)
    run(rates[0] if rates else FRACTIONS[0] * warm.requests / warm.seconds, WARM_UP + 1)
    runs = [run(math.inf, 0)]
    log(f"  burst: {runs[0].requests / runs[0].seconds:.2f} req/s, {runs[0].tok_s:,.0f} tok/s")
    saturation = runs[0].requests / runs[0].seconds
    chosen = list(rates) if rates else [f * saturation for f in FRACTIONS]
    for i, rate in enumerate(chosen, start=1):
        runs.append(run(rate, i))
        r = runs[-1]
        log(f"  {rate:.2f} req/s: {r.tok_s:,.0f} tok/s, TTFT p50 {pct(r.ttft_ms, 50):.1f} ms, "
            f"ITL p50 {pct(r.itl_ms, 50):.2f} ms")  # fmt: skip
    return runs, chosen


def bench_model(args: argparse.Namespace, name: str, log: Callable[[str], None]) -> list[RateRun]:
    from worker.executor import Executor

    n, p, o = args.requests, args.prompt, args.output
    path: Path | None = None
    tmp: tempfile.TemporaryDirectory[str] | None = None
    if name == "8b":
        executor, vocab = executor_8b(args)
    else:
        if name == "tiny":
            tmp = tempfile.TemporaryDirectory(prefix="tokenwire-serving-")
            path = tiny_checkpoint(Path(tmp.name))
        else:
            from worker.models.default_model import DefaultModelUnavailable, resolve_model

            try:
                path = resolve_model(DEFAULT_MODEL if name == "default" else name)
            except DefaultModelUnavailable as e:
                raise SkipSection(str(e)) from None
        vocab = vocab_size(path)
        executor = Executor.from_model(path, executor_config(args))
    label = (name if name in ("tiny", "default", "8b") else Path(name).name) + variant(args)
    runs: list[RateRun] = []
    try:
        with executor:
            blocks = executor.core.blocks
            kv_tokens = blocks.num_blocks * blocks.block_size
            log(f"{label}, in process: {n} requests x {p} / {o} tokens, KV cache {kv_tokens} tokens")
            local, rates = sweep(partial(_in_process_at, executor, label, n, p, o, vocab), args.rates, log)
            runs += local
        del executor
        release_device_memory()  # the worker process sizes its KV cache from what is free
        if path is not None and "service" in args.paths:
            worker_args = ["--max-batch-size", str(args.max_batch), "--max-num-tokens", str(args.max_num_tokens)]
            # The worker's KV cache holds as many of these requests as the in-process one did (at
            # most all of them: a cache sized from free memory could not be had again in a second
            # process). With less, fewer run at once and the rest queue: a smaller service, not a
            # slower path (the first serving tables were measured so: 17,408 tokens, 68 requests).
            worker_args += ["--kv-tokens", str(min(kv_tokens, n * (p + o + blocks.block_size)))]
            worker_args += ["--device", args.device] if args.device else []
            worker_args += ["--quantization", args.quantization] if args.quantization else []
            worker_args += ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else []
            stack = Stack(path, *worker_args, gateways=args.gateways)
            # Several client processes: one Python client tops out near 20,000 streamed tokens/s
            # (bench/results/serving_cpu_per_process_llama1b_h200_2026-11-29.txt), below what a GPU makes.
            pool = None if args.clients <= 1 else ProcessPoolExecutor(args.clients, mp_context=get_context("spawn"))
            try:
                log(f"{label}, gateway + worker: the same rates, {max(1, args.clients)} client process(es)")
                remote, _ = sweep(partial(_service_at, stack, stack.gateways, label, n, p, o, vocab, pool,
                                          args.clients), rates, log)  # fmt: skip
                runs += remote
                if "http" in args.paths:
                    log(f"{label}, HTTP + SSE: the same rates")
                    # One port, whatever the number of gateway processes: the kernel spreads the connections.
                    url = f"http://127.0.0.1:{stack.http_port}/{path.name}"
                    urls = [url] * args.gateways
                    over_http, _ = sweep(partial(_service_at, stack, urls, label, n, p, o, vocab, pool,
                                                 args.clients), rates, log)  # fmt: skip
                    runs += over_http
            finally:
                if pool is not None:
                    pool.shutdown()
                stack.close()
    finally:
        if tmp is not None:
            tmp.cleanup()
    return runs


def run(args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    runs: list[RateRun] = []
    skipped = []
    for name in args.model.split(","):
        try:
            runs += bench_model(args, name, log)
        except SkipSection as e:  # the other models' rows still count
            log(f"{name}: skipped: {e}")
            skipped.append(f"{name}: {e}")
    if not runs:
        raise SkipSection("; ".join(skipped))
    rows = [r.row() for r in runs]
    rows.append([f"({args.requests} x {args.prompt}/{args.output} per rate)", *[""] * (len(HEADER) - 1)])
    out = os.environ.get("OUT")
    if out:
        save_runs(Path(out) / "serving_bench.json.gz", args, runs)
    return HEADER, rows


def save_runs(path: Path, args: argparse.Namespace, runs: Sequence[RateRun]) -> None:
    """Every request's latencies, to the microsecond and gzipped: what `bench.plots` draws
    the serving curves from, small enough to keep in bench/results/."""

    def rounded(value: Any) -> Any:
        if isinstance(value, PromptSteps):
            return {"steps": value.steps, "last_ms": value.last_ms, "first_held": value.first_held}
        return [round(v, 3) for v in value] if isinstance(value, list) else value

    saved = {"args": vars(args), "runs": [{k: rounded(getattr(r, k)) for k in r.__slots__} for r in runs]}
    with gzip.open(path, "wt") as f:
        json.dump(saved, f, default=str)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="8b,default",
                   help="comma-separated: 8b (in process only), default, tiny, or a checkpoint directory")
    p.add_argument("--paths", default="inprocess,service",
                   help="inprocess, inprocess,service or inprocess,service,http (HTTP + SSE to the same service)")
    p.add_argument("--requests", type=int, default=512, help="requests at each rate")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   help="requests/s, comma-separated (default: 0.25, 0.5, 0.75, 1 x the burst's)")
    p.add_argument("--clients", type=int, default=4, help="client processes the service's requests are spread over")
    p.add_argument("--gateways", type=int, default=1,
                   help="gateway processes (one HTTP port between them; ZeroMQ clients spread over their ports)")
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--kv-tokens", type=int, default=0, help="KV cache tokens (default: sized from free memory)")
    p.add_argument("--device", default=None, help="torch device for the model (default: cuda when present)")
    p.add_argument("--quantization", default=None, choices=["fp8", "int4"], help="quantize every model on load")
    p.add_argument("--kv-cache-dtype", default=None, choices=["fp8"], help="an e4m3 KV cache (the torch backend)")
    return p


def table() -> tuple[list[str], list[list[str]]]:
    """`make bench` section: on CUDA only (bench/run.py)."""
    import torch

    if not torch.cuda.is_available():
        raise SkipSection("no CUDA device (on the CPU: python -m bench.serving_bench --model tiny)")
    return run(parser().parse_args([]))


def main() -> None:
    from bench.run import format_table

    print(format_table(*run(parser().parse_args())))


if __name__ == "__main__":
    main()
