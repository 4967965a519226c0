"""gpu_bench over N GPUs (`python -m bench.gpu_bench --tensor-parallel-size T
--pipeline-parallel-size P`, N = T * P): the executor on a tensor- and/or
pipeline-parallel torch backend (worker/parallel), one process per GPU, random bf16
weights made on each rank's GPU one tensor at a time (only its stage's layers) and cut
to the rank's shard at once (the whole model is never on one device nor on the host);
with `--quantization fp8|int4` each shard is quantized as it is made, as a worker does.
Pipeline stages run without CUDA graphs.

Shapes: the Llama-3.1-8B shape of gpu_bench, or `--model-shape 70b` (Llama-3.1-70B:
hidden 8192, 80 layers, 64 query / 8 KV heads, intermediate 28672, vocab 128256),
`qwen3-8b`, `gemma3-12b`, `qwen3-30b-a3b`, `gpt-oss-20b` or `gpt-oss-120b`
(bench/model_shapes.py), on one GPU or more; gpt-oss's experts packed in MXFP4 as it
ships them unless `--expert-dtype bf16` (bench/random_weights.py makes them packed, so
the 120b shape fits one GPU).
The roofline is N GPUs': each rank measures its HBM bandwidth and bf16 GEMM rate at
start (the FP8 GEMM rate with `--quantization fp8`), and the floors use their sums
(all-reduce traffic is not counted in them), over the quantized bytes when quantized (the
routed experts' at their packed size when MXFP4). Under
pipeline parallelism a batch-1 step runs the stages one after the other, so its TPOT
floor is the sum's P times (Roofline.stages).
"""

from __future__ import annotations

import argparse
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from bench import SkipSection, free_port, log
from bench.device_rates import measure_bandwidth, measure_fp8_gemm, measure_gemm, sync
from bench.model_shapes import hf_config, shape_name
from bench.offline_runs import Row, bench_executor
from bench.random_weights import RandomTensors
from bench.roofline import Roofline, roofline_of
from worker.models.config import ModelConfig


def _shape(args: argparse.Namespace) -> dict[str, Any]:
    return hf_config(shape_name(args.model_shape, args.tiny))


def _rank_setup(rank: int, args: argparse.Namespace) -> tuple[Any, Any, float, float]:
    """Join the world, measure this GPU and sum over the GPUs, build the rank's shard."""
    from worker.backends.torch_backend import TorchBackend
    from worker.parallel.group import join

    device_type = torch.device(args.device).type
    world = join(rank, args.tensor_parallel_size, args.port, device_type, args.pipeline_parallel_size)
    bandwidth = measure_bandwidth(world.device)
    fp8 = args.quantization == "fp8" and device_type == "cuda"  # torch._scaled_mm is CUDA's
    flops = measure_fp8_gemm(world.device) if fp8 else measure_gemm(world.device)
    sums = torch.tensor([bandwidth, flops], dtype=torch.float64, device=world.device)
    torch.distributed.all_reduce(sums)
    cfg = ModelConfig.from_hf(_shape(args))
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    t0 = time.perf_counter()
    backend = TorchBackend(cfg, dtype=dtype, weights=RandomTensors(cfg, world.device, dtype, args.expert_dtype),
                           max_num_tokens=args.max_num_tokens, max_model_len=args.max_model_len,
                           max_graph_batch=args.max_batch, world=world,
                           micro_batch_count=args.micro_batches, quantization=args.quantization,
                           kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    sync(world.device)
    if rank == 0:
        held = torch.cuda.memory_allocated(world.device) if device_type == "cuda" else 0
        log(f"rank shards made in {time.perf_counter() - t0:.1f} s; {held / 1e9:.1f} GB on rank 0's GPU")
    return world, backend, float(sums[0]), float(sums[1])


def _follower(rank: int, inbox: Connection, parent: int, args: argparse.Namespace) -> None:
    from ops.process import follow_parent
    from worker.parallel.group import leave
    from worker.parallel.ranks import serve

    follow_parent(parent)
    world, backend, _, _ = _rank_setup(rank, args)
    serve(backend, world, inbox)
    leave()


def run(args: argparse.Namespace, workloads: list[tuple[int, int, int, int]],
        env: dict[str, str]) -> tuple[list[Row], Roofline, float, float]:  # fmt: skip
    """The tokenwire rows of every workload over --tensor-parallel-size x --pipeline-parallel-size ranks."""
    from worker.executor.types import ParallelConfig
    from worker.parallel import layout
    from worker.parallel.ranks import DistributedBackend, spawn_ranks

    parallel = ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size, args.micro_batches)
    size = parallel.world_size
    cfg = ModelConfig.from_hf(_shape(args))
    layout.validate(parallel, cfg)
    if torch.device(args.device).type == "cuda" and torch.cuda.device_count() < size:
        raise SkipSection(f"{size} ranks: {torch.cuda.device_count()} GPUs visible")
    args.port = free_port()
    t0 = time.perf_counter()
    links, processes = spawn_ranks(size, _follower, (args,))
    world, backend, bandwidth, flops = _rank_setup(0, args)
    distributed = DistributedBackend(backend, world, links, processes)
    dtype_bytes = 2 if args.dtype == "bfloat16" else 4
    roof = roofline_of(cfg, args.quantization, dtype_bytes, bandwidth, flops, args.pipeline_parallel_size,
                       args.kv_cache_dtype, args.expert_dtype)
    experts = ", MXFP4 experts" if args.expert_dtype == "mxfp4" else ""
    log(f"{size} ranks up in {time.perf_counter() - t0:.1f} s; rank 0 runs {backend.quantization or args.dtype} "
        f"weights, a {args.kv_cache_dtype or args.dtype} KV cache{experts}; roofline of {size} GPUs: "
        f"{bandwidth / 1e12:.2f} TB/s, "
        f"{flops / 1e12:.0f} TFLOP/s; weights {roof.weight_bytes / 1e9:.1f} GB{roof.experts_note()} -> "
        "batch-1 TPOT floor "
        f"{roof.decode_floor(0) * 1e3:.2f} ms")  # fmt: skip
    try:
        rows = bench_executor(args, cfg, distributed, workloads, roof)
    finally:
        distributed.close()
    return rows, roof, bandwidth, flops
