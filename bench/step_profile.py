"""Single forward + sample steps straight on a backend: their median time and host launch
time, and the torch profiler's kernel breakdown of a few."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from bench import log


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
