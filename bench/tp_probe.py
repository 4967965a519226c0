"""What a tensor-parallel step's parts cost on two GPUs, apart from the model
(`python3 -m bench.tp_probe`, CUDA, two GPUs): NCCL's all-reduce of rows x 8192 bf16,
the four projections of one 70B layer's TP=2 shard at several row counts (the GEMM rate
a step really gets, against the 8192^3 burst of the roofline), and a GEMM beside an
all-reduce on two streams against the two one after the other (whether overlapping
them on streams pays). Each figure is a call's share of replays of a CUDA graph of 20
calls, so launches stay out of it. Last, one layer's four projections as tensor
parallelism runs them today (GEMM, then an all-reduce after o and down) against the
sequence-parallel form (torch's symmetric-memory all-gather fused into qkv and gate_up,
reduce-scatter fused into o and down): those run eagerly (barriers between the ranks),
timed over repeated calls."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.quant_bench import graph_call_seconds
from bench.tp_bench import LLAMA_70B, _free_port
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
    lines += _sequence_parallel_lines(weights, device)
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _eager_us(fn: Callable[[], object], calls: int = 20) -> float:
    fn()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def _sequence_parallel_lines(weights: dict[str, torch.Tensor], device: torch.device) -> list[str]:
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD
    assert group is not None
    name = group.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(name)
    w = {k: v.t() for k, v in weights.items()}  # [in, out]
    return [_sequence_parallel_line(rows, w, name, device) for rows in (512, 2048, 8192)]


def _sequence_parallel_line(rows: int, w: dict[str, torch.Tensor], name: str, device: torch.device) -> str:
    ops = torch.ops.symm_mem
    x = torch.randn(rows, H, device=device, dtype=torch.bfloat16)
    mine = x.chunk(2)[dist.get_rank()].contiguous()
    attn = torch.randn(rows, SHARD["o"][0], device=device, dtype=torch.bfloat16)
    act = torch.randn(rows, SHARD["down"][0], device=device, dtype=torch.bfloat16)

    def all_reduce_layer() -> None:
        torch.matmul(x, w["qkv"])
        dist.all_reduce(torch.matmul(attn, w["o"]))
        torch.matmul(x, w["gate_up"])
        dist.all_reduce(torch.matmul(act, w["down"]))

    def fused_layer() -> None:
        ops.fused_all_gather_matmul(mine, [w["qkv"]], 0, name)
        ops.fused_matmul_reduce_scatter(attn, w["o"], "sum", 0, name)
        ops.fused_all_gather_matmul(mine, [w["gate_up"]], 0, name)
        ops.fused_matmul_reduce_scatter(act, w["down"], "sum", 0, name)

    def plain_layer() -> None:  # the same collectives unfused: NCCL all-gather, reduce-scatter
        gathered = torch.empty_like(x)
        dist.all_gather_into_tensor(gathered, mine)
        torch.matmul(gathered, w["qkv"])
        dist.reduce_scatter_tensor(torch.empty_like(mine), torch.matmul(attn, w["o"]))
        dist.all_gather_into_tensor(gathered, mine)
        torch.matmul(gathered, w["gate_up"])
        dist.reduce_scatter_tensor(torch.empty_like(mine), torch.matmul(act, w["down"]))

    # The fused ops' results, against the unfused ones (a wrong sum would make the timing moot).
    _, (fused_qkv,) = ops.fused_all_gather_matmul(mine, [w["qkv"]], 0, name)
    fused_down = ops.fused_matmul_reduce_scatter(act, w["down"], "sum", 0, name)
    summed = torch.matmul(act, w["down"])
    dist.all_reduce(summed)
    err = max((fused_qkv - torch.matmul(x, w["qkv"])).abs().max().item(),
              (fused_down - summed.chunk(2)[dist.get_rank()]).abs().max().item())  # fmt: skip
    times = {"GEMM + all-reduce": _eager_us(all_reduce_layer), "fused sequence-parallel": _eager_us(fused_layer),
             "unfused sequence-parallel": _eager_us(plain_layer)}  # fmt: skip
    return (
        f"one 70B layer's projections at {rows} rows: "
        + ", ".join(f"{k} {t:.0f} us" for k, t in times.items())
        + f" (fused max |diff| {err:.3g})"
    )


def main() -> None:
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench.tp_probe needs two CUDA devices")
    mp.spawn(_rank, args=(_free_port(),), nprocs=2)


if __name__ == "__main__":
    main()
