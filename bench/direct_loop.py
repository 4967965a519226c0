"""The backend alone, without the executor: the gap to the executor is the executor's cost."""

from __future__ import annotations

import time
from typing import Any

import numpy as np


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
