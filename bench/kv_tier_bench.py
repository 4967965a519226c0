"""The KV cache's host tier on a multi-turn chat workload, with and without it.

N conversations share a long system prompt; each turn's prompt is the conversation so
far (system prompt, then every user message and every answer before) plus a new user
message, and the turns go in waves: every conversation's turn t, then every one's turn
t + 1 once those answers are in, as users reply. The device KV pool is sized to a third
of what the last wave's prompts hold (their distinct blocks), so by a conversation's
next turn most of its earlier blocks have been evicted: without the tier they are
computed again, with it (sized to hold the whole working set) they are copied back.

The table: of every prompt token, how many were found on the device, found in the
host tier, or computed (a miss); TTFT p50 / p99 over every request (streamed, from
enqueue to first token, each wave's requests enqueued at once); and wall time.
The model has random weights (bench/random_weights.py), the executor runs in process.

    python -m bench.kv_tier_bench                      # Llama-3.1-8B shape, bf16, one GPU
    python -m bench.kv_tier_bench --device cpu --tiny  # the code paths, in seconds

Needs only torch, numpy and safetensors.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from bench import SkipSection, log
from bench.device_rates import sync
from bench.environment import environment
from bench.model_shapes import LLAMA_8B, TINY
from bench.random_weights import random_weights

TITLE = "KV host tier: multi-turn chat, device pool a third of the working set"


@dataclass(slots=True)
class Run:
    name: str
    host_blocks: int
    device_tokens: int  # prompt tokens found on the device
    host_tokens: int  # found in the host tier
    miss_tokens: int  # computed
    ttft_p50_ms: float
    ttft_p99_ms: float
    seconds: float
    offloaded_blocks: int

    @property
    def prompt_tokens(self) -> int:
        return self.device_tokens + self.host_tokens + self.miss_tokens


def conversations(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt, and each conversation's user messages (one per turn)."""
    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(args.system_tokens)]
    users = [[[rng.randrange(3, vocab) for _ in range(args.user_tokens)] for _ in range(args.turns)]
             for _ in range(args.conversations)]  # fmt: skip
    return system, users


def working_set_tokens(args: argparse.Namespace) -> int:
    """The distinct tokens the last wave's prompts hold: the system prompt once, and each
    conversation's every message."""
    per_turn = args.user_tokens + args.output_tokens
    return args.system_tokens + args.conversations * (args.turns * per_turn - args.output_tokens)


def start_executor(args: argparse.Namespace, cfg: Any, weights: dict[str, torch.Tensor], device: torch.device,
                   host_bytes: int) -> Any:  # fmt: skip
    from worker.backends.torch_backend import TorchBackend
    from worker.executor import EngineCore, Executor, ExecutorConfig, KvCacheConfig

    backend = TorchBackend(cfg, device, args.dtype, weights=weights, max_num_tokens=args.max_num_tokens,
                           max_model_len=args.max_model_len, max_graph_batch=args.max_batch,
                           max_batch_size=args.max_batch)  # fmt: skip
    kv = KvCacheConfig(tokens_per_block=args.block_size, max_tokens=args.device_tokens, host_cache_size=host_bytes)
    config = ExecutorConfig(max_batch_size=args.max_batch, max_num_tokens=args.max_num_tokens, kv_cache_config=kv,
                            iteration_stats_max=1_000_000)  # fmt: skip
    return Executor(EngineCore(backend, config))


def run_waves(executor: Any, args: argparse.Namespace, system: list[int],
              users: list[list[list[int]]]) -> tuple[list[float], float]:  # fmt: skip
    """Every turn as one wave of streamed requests; (TTFT of each request in ms, seconds)."""
    from worker.executor import Request

    history = [list(system) for _ in users]
    ttfts: list[float] = []
    t_start = time.perf_counter()
    for turn in range(args.turns):
        prompts = [h + u[turn] for h, u in zip(history, users, strict=True)]
        requests = [Request(input_token_ids=p, max_tokens=args.output_tokens, end_id=-1, streaming=True)
                    for p in prompts]  # fmt: skip
        t0 = time.perf_counter()
        ids = executor.enqueue_requests(requests)
        first: dict[int, float] = {}
        answers: dict[int, list[int]] = {i: [] for i in ids}
        pending = set(ids)
        while pending:
            for r in executor.await_responses(timeout=600.0):
                if r.has_error:
                    raise RuntimeError(f"request {r.request_id}: {r.error_msg}")
                first.setdefault(r.request_id, time.perf_counter())
                answers[r.request_id] += r.result.output_token_ids[0]
                if r.result.is_final:
                    pending.discard(r.request_id)
        ttfts += [(first[i] - t0) * 1e3 for i in ids]
        history = [p + answers[i] for p, i in zip(prompts, ids, strict=True)]
    return ttfts, time.perf_counter() - t_start


def measure(args: argparse.Namespace, cfg: Any, weights: dict[str, torch.Tensor], device: torch.device,
            name: str, host_bytes: int) -> Run:  # fmt: skip
    executor = start_executor(args, cfg, weights, device, host_bytes)
    try:
        system, users = conversations(args, cfg.vocab_size)
        warm_system, warm_users = [1] * args.block_size, [[[2] * args.block_size]]  # compiles the kernels
        run_waves(executor, argparse.Namespace(**{**vars(args), "turns": 1}), warm_system, warm_users)
        executor.get_latest_request_stats()
        ttfts, seconds = run_waves(executor, args, system, users)
        requests = executor.get_latest_request_stats()
        last = executor.get_latest_iteration_stats()[-1]
        host_blocks = 0 if executor.core.blocks.host is None else executor.core.blocks.host.num_blocks
    finally:
        executor.shutdown()
    bs = args.block_size
    reused = sum(s.reused_blocks for s in requests) * bs
    on_host = sum(s.reused_host_blocks for s in requests) * bs
    prompt = sum(s.prompt_tokens for s in requests)
    run = Run(name, host_blocks, reused - on_host, on_host, prompt - reused, float(np.percentile(ttfts, 50)),
              float(np.percentile(ttfts, 99)), seconds, last.offloaded_blocks)  # fmt: skip
    log(f"{name}: {asdict(run)}")
    return run


def table_rows(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    header = ["run", "host blocks", "prompt tokens", "device hit", "host hit", "miss", "TTFT p50 ms", "TTFT p99 ms",
              "offloaded", "wall s"]  # fmt: skip
    rows = []
    for r in runs:
        total = r.prompt_tokens or 1
        rows.append([r.name, f"{r.host_blocks:,}", f"{r.prompt_tokens:,}", f"{r.device_tokens / total:.1%}",
                     f"{r.host_tokens / total:.1%}", f"{r.miss_tokens / total:.1%}", f"{r.ttft_p50_ms:,.1f}",
                     f"{r.ttft_p99_ms:,.1f}", f"{r.offloaded_blocks:,}", f"{r.seconds:.2f}"])  # fmt: skip
    return header, rows


def run(args: argparse.Namespace) -> tuple[str, list[str], list[list[str]]]:
    from worker.models.config import ModelConfig

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SkipSection("no CUDA device")
    cfg = ModelConfig.from_hf(TINY if args.tiny else LLAMA_8B)
    env = environment(device)
    log("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    weights = random_weights(cfg, device, dtype)
    sync(device)
    working = working_set_tokens(args)
    longest = args.system_tokens + args.turns * (args.user_tokens + args.output_tokens)
    # A third of the working set, but never less than the longest request needs (or nothing runs).
    args.device_tokens = max(working // 3, -(-longest // args.block_size) * args.block_size)
    bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    host_bytes = int(args.host_factor * working * bytes_per_token)
    log(f"working set {working:,} tokens, device pool {args.device_tokens:,} tokens "
        f"({working / args.device_tokens:.1f}x smaller), host tier {host_bytes / (1 << 30):.2f} GiB")  # fmt: skip
    runs = []
    for name, host in (("device only", 0), ("device + host tier", host_bytes)):
        runs.append(measure(args, cfg, weights, device, name, host))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    header, rows = table_rows(runs)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "kv_tier_bench.json"), "w") as f:
            json.dump({"environment": env, "args": vars(args), "runs": [asdict(r) for r in runs]}, f, indent=1,
                      default=str)  # fmt: skip
    title = (f"{TITLE}: {args.conversations} conversations x {args.turns} turns, system {args.system_tokens}, "
             f"user {args.user_tokens}, answer {args.output_tokens} tokens")  # fmt: skip
    return title, header, rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--dtype", default=None, choices=["bfloat16", "float32"], help="default: bfloat16 on CUDA, float32 on the CPU"
    )
    p.add_argument("--tiny", action="store_true", help="a tiny model and workload: the code paths, not the speed")
    p.add_argument("--conversations", type=int, default=None, help="default 32; tiny 8")
    p.add_argument("--turns", type=int, default=None, help="default 4; tiny 3")
    p.add_argument("--system-tokens", type=int, default=None, help="the shared system prompt (default 2048; tiny 64)")
    p.add_argument("--user-tokens", type=int, default=None, help="each user message (default 256; tiny 16)")
    p.add_argument("--output-tokens", type=int, default=None, help="each answer (default 128; tiny 8)")
    p.add_argument("--host-factor", type=float, default=1.5, help="the host tier, in working sets")
    p.add_argument("--max-batch", type=int, default=None, help="default 32; tiny 4")
    p.add_argument("--max-num-tokens", type=int, default=None, help="default 8192; tiny 256")
    p.add_argument("--max-model-len", type=int, default=None, help="default 8192; tiny 512")
    p.add_argument("--block-size", type=int, default=None, help="default 32; tiny 16")
    return p


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    full = {"conversations": 32, "turns": 4, "system_tokens": 2048, "user_tokens": 256, "output_tokens": 128,
            "max_batch": 32, "max_num_tokens": 8192, "max_model_len": 8192, "block_size": 32}  # fmt: skip
    tiny = {"conversations": 8, "turns": 3, "system_tokens": 64, "user_tokens": 16, "output_tokens": 8,
            "max_batch": 4, "max_num_tokens": 256, "max_model_len": 512, "block_size": 16}  # fmt: skip
    for key, value in (tiny if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return args


def main() -> None:
    from bench.run import format_table

    title, header, rows = run(_defaults(parser().parse_args()))
    print(f"\n== {title}")
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
