"""A greedy decoding loop over forward + sample for any Backend, on scattered KV blocks:
the parity tests' stand-in for the executor."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.worker.backends.paged_batches import PagedSequences
from worker.backends.base import SamplingBatch


def greedy_run(
    backend: Any,
    prompts: dict[str, list[int]],
    new_tokens: int,
    seed: int,
    block_size: int = 4,
    num_blocks: int = 96,
    chunk: int = 5,
) -> dict[str, list[int]]:
    """Greedy decoding of several prompts at once through forward + sample, with the
    prompts prefilled in chunks alongside the others' generation steps."""
    paged = PagedSequences(num_blocks=num_blocks, block_size=block_size, seed=seed)
    tokens = {s: list(p) for s, p in prompts.items()}
    done = dict.fromkeys(prompts, 0)  # tokens already in the cache
    out: dict[str, list[int]] = {s: [] for s in prompts}
    while any(len(o) < new_tokens for o in out.values()):
        parts = []
        for s in prompts:
            if len(out[s]) < new_tokens:
                count = min(chunk, len(tokens[s]) - done[s])
                parts.append((s, tokens[s], done[s], count))
        batch = paged.step(parts, all_logits=False)
        logits = backend.forward(batch)
        samplers = [i for i, (s, toks, start, count) in enumerate(parts) if start + count == len(toks)]
        rows = np.asarray(samplers, dtype=np.int64)
        sampling = SamplingBatch(
            temperature=np.zeros(len(parts), np.float32),
            top_k=np.zeros(len(parts), np.int64),
            top_p=np.ones(len(parts), np.float32),
            min_p=np.zeros(len(parts), np.float32),
            uniform=np.zeros(len(parts)),
            ban_rows=np.zeros(0, np.int64),
            ban_tokens=np.zeros(0, np.int64),
        )
        ids = backend.sample(logits, sampling).token_ids
        for i, (s, _, start, count) in enumerate(parts):
            done[s] = start + count
            if i in rows:
                tokens[s].append(int(ids[i]))
                out[s].append(int(ids[i]))
    return out
