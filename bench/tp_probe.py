"""What a tensor-parallel step's parts cost on two GPUs, apart from the model
(`python3 -m bench.tp_probe`, CUDA, two GPUs): NCCL's all-reduce of rows x 8192 bf16,
the four projections of one 70B layer's TP=2 shard at several row counts (the GEMM rate
a step really gets, against the 8192^3 burst of the roofline), and a GEMM beside an
all-reduce on two streams against the two one after the other (whether overlapping
them on streams pays). Each figure is a call's share of replays of a CUDA graph of 20
calls, so launches stay out of it."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import free_port
from bench.device_rates import graph_call_seconds
from bench.model_shapes import LLAMA_70B
from worker.parallel.group import NO_MULTICAST_ENV

H = LLAMA_70B["hidden_size"]
HEADS, KV_HEADS, FF = LLAMA_70B["num_attention_heads"], LLAMA_70B["num_key_value_heads"], LLAMA_70B["intermediate_size"]
D = H // HEADS
SHARD = {  # (in, out) of each projection on one of two ranks
    "qkv": (H, (HEADS + 2 * KV_HEADS) * D // 2),
    "o": (HEADS * D // 2, H),
    "gate_up": (H, FF),
    "down": (FF // 2, H),
}


def _us(fn: Callable[[], object]) -> float:
    return graph_call_seconds(fn, torch.device("cuda", torch.cuda.current_device())) * 1e6


def _rank(rank: int, port: int) -> None:
    os.environ.update(NO_MULTICAST_ENV)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=device)  # fmt: skip
    dist.all_reduce(torch.zeros(1, device=device))
    lines = []
    for rows in (1, 64, 128, 256, 512, 1024, 2048, 8192):
        x = torch.randn(rows, H, device=device, dtype=torch.bfloat16)
        t = _us(partial(dist.all_reduce, x))
        lines.append(f"all_reduce {rows:5d} x {H}: {t:8.1f} us ({x.numel() * 2 / t / 1e3:6.1f} GB/s)")
    weights = {k: torch.randn(o, i, device=device, dtype=torch.bfloat16) * 0.02 for k, (i, o) in SHARD.items()}
    for rows in (256, 512, 1024, 8192):
        parts = {}
        for k, (i, _) in SHARD.items():
            x = torch.randn(rows, i, device=device, dtype=torch.bfloat16)
            parts[k] = _us(partial(torch.matmul, x, weights[k].t()))
        total = sum(parts.values())
        flops = 2 * rows * sum(i * o for i, o in SHARD.values())
        lines.append(f"layer GEMMs at {rows:5d} rows: {total:8.1f} us ({flops / total / 1e6:4.0f} TFLOP/s) "
                     f"[{', '.join(f'{k} {t:.0f}' for k, t in parts.items())} us]")  # fmt: skip
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    for rows in (256, 512, 4096):
        x = torch.randn(rows, H, device=device, dtype=torch.bfloat16)
        y = torch.randn(rows, H, device=device, dtype=torch.bfloat16)
        w = weights["gate_up"]

        def side_by_side(x: torch.Tensor = x, y: torch.Tensor = y, w: torch.Tensor = w) -> None:
            main = torch.cuda.current_stream()
            a.wait_stream(main)
            b.wait_stream(main)
            with torch.cuda.stream(a):
                torch.matmul(x, w.t())
            with torch.cuda.stream(b):
                dist.all_reduce(y)
            main.wait_stream(a)
            main.wait_stream(b)

        gemm = _us(partial(torch.matmul, x, w.t()))
        reduce = _us(partial(dist.all_reduce, y))
        lines.append(f"gate_up GEMM and all-reduce, {rows} rows: {gemm:.0f} + {reduce:.0f} us one after the other, "
                     f"{_us(side_by_side):.0f} us side by side")  # fmt: skip
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench.tp_probe needs two CUDA devices")
    mp.spawn(_rank, args=(free_port(),), nprocs=2)


if __name__ == "__main__":
    main()
