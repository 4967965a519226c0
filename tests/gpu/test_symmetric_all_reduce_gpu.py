"""The activations' all-reduce on two GPUs (worker/parallel/symmetric_all_reduce.py):
whichever method each size took at start, sums equal NCCL's, eagerly and replayed from a
CUDA graph, at row counts on and between the measured rungs, past the last one, and for
inputs it must hand to NCCL (another dtype). Every rung names its method and the timings
of each method kept."""

from __future__ import annotations

import faulthandler
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
HIDDEN = 1024
MAX_ROWS = 2048
RANK_SECONDS = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, failures: mp.Queue) -> None:
    from worker.parallel.group import join, leave

    # A rank stuck in a collective prints where, and exits, before the test gives up on it.
    faulthandler.dump_traceback_later(RANK_SECONDS, exit=True)
    world = join(rank, 2, port, "cuda")
    try:
        _check(rank, world.device)
    except Exception as e:  # reported, not raised: its traceback would keep _check's graphs alive
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
    leave()  # after _check's graphs are gone: a live graph's collectives keep the group from tearing down


def _check(rank: int, device: torch.device) -> None:
    from worker.parallel.symmetric_all_reduce import ActivationAllReduce

    summed = ActivationAllReduce(None, device, torch.bfloat16, HIDDEN, MAX_ROWS)
    assert len(summed.choice) == len(summed.rungs) and summed.rungs[-1] == MAX_ROWS
    assert set(summed.choice) <= set(summed.timings) and "nccl" in summed.timings
    gen = torch.Generator(device=device).manual_seed(rank)
    bf16 = torch.bfloat16
    for rows, dtype in [(1, bf16), (7, bf16), (64, bf16), (300, bf16), (MAX_ROWS, bf16), (MAX_ROWS + 5, bf16),
                        (64, torch.float32)]:  # fmt: skip
        x = torch.randn(rows, HIDDEN, device=device, dtype=dtype, generator=gen)
        want = x.float()
        dist.all_reduce(want)
        eager = x.clone()
        assert summed(eager) is eager
        graphed = x.clone()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            summed(x.clone())
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            summed(graphed)
        graph.replay()
        torch.cuda.synchronize()
        for got in (eager, graphed):
            # bf16 inputs, summed in float32 or bf16: one rounding of the sum apart.
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
    if rank == 0:
        print(f"activation all-reduce: {summed.describe()}")


def test_sums_equal_nccls_whatever_method_each_size_took() -> None:
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, failures)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(RANK_SECONDS + 30)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert failures.empty(), failures.get()
    assert not alive, "a rank hung"
    assert all(p.exitcode == 0 for p in procs)
