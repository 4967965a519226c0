"""Turn a scheduled batch into the arrays a backend consumes."""

from __future__ import annotations

import numpy as np

from worker.backends.base import ForwardBatch, SamplingBatch
from worker.executor.scheduler import ScheduledBatch
from worker.executor.sequence import Sequence

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def uniform_draws(seeds: np.ndarray, sequence_index: np.ndarray, step: np.ndarray) -> np.ndarray:
    """A counter-based draw in [0, 1) per (seed, sequence, step): the same request
    draws the same numbers whatever it is batched with, and after a preemption."""
    x = _splitmix64(seeds.astype(np.uint64))
    x = _splitmix64(x ^ sequence_index.astype(np.uint64))
    x = _splitmix64(x ^ step.astype(np.uint64))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def build_forward_batch(batch: ScheduledBatch, block_size: int) -> ForwardBatch:
    seqs = batch.seqs
    counts = np.asarray(batch.num_new_tokens, dtype=np.int64)
    starts = np.fromiter((s.num_computed for s in seqs), dtype=np.int64, count=len(seqs))
    query_start = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    total = int(query_start[-1])

    token_ids = np.empty(total, dtype=np.int64)
    for seq, a, b, lo in zip(seqs, query_start[:-1], query_start[1:], starts, strict=True):
        token_ids[a:b] = seq.token_ids[lo : lo + (b - a)]
    # positions[t] = start of its sequence + offset within this step's chunk
    seq_of_token = np.repeat(np.arange(len(seqs)), counts)
    positions = starts[seq_of_token] + (np.arange(total) - query_start[:-1][seq_of_token])

    max_blocks = max(len(s.blocks.block_ids) for s in seqs)
    block_tables = np.zeros((len(seqs), max_blocks), dtype=np.int64)
    for i, seq in enumerate(seqs):
        ids = seq.blocks.block_ids
        block_tables[i, : len(ids)] = ids
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    context_lens = starts + counts
    samples = context_lens == np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
    logits_indices = query_start[1:][samples] - 1
    return ForwardBatch(
        token_ids=token_ids,
        positions=positions,
        query_start=query_start,
        context_lens=context_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        logits_indices=logits_indices,
    )


def build_sampling_batch(seqs: list[Sequence]) -> SamplingBatch:
    """Sampling arrays for the sequences that sample this step, in batch order."""
    params = np.array([s.sampling_params for s in seqs], dtype=np.float64).reshape(len(seqs), 4)
    seeds = np.fromiter((s.seed for s in seqs), dtype=np.uint64, count=len(seqs))
    index = np.fromiter((s.sequence_index for s in seqs), dtype=np.uint64, count=len(seqs))
    steps = np.fromiter((s.num_generated for s in seqs), dtype=np.uint64, count=len(seqs))
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    for row, seq in enumerate(seqs):
        for token in banned_tokens(seq):
            ban_rows.append(row)
            ban_tokens.append(token)
    return SamplingBatch(
        temperature=params[:, 0].astype(np.float32),
        top_k=params[:, 1].astype(np.int64),
        top_p=params[:, 2].astype(np.float32),
        min_p=params[:, 3].astype(np.float32),
        uniform=uniform_draws(seeds, index, steps),
        ban_rows=np.asarray(ban_rows, dtype=np.int64),
        ban_tokens=np.asarray(ban_tokens, dtype=np.int64),
    )


def banned_tokens(seq: Sequence) -> list[int]:
    """The end token before min_tokens, and the last token of any bad word whose
    prefix the sequence just produced."""
    banned: list[int] = []
    min_tokens = seq.request.sampling_config.min_tokens or 0
    if seq.end_id >= 0 and seq.num_generated < min_tokens:
        banned.append(seq.end_id)
    tokens = seq.token_ids
    for word in seq.bad_words:
        k = len(word) - 1
        if k == 0 or (k <= len(tokens) and tokens[len(tokens) - k :] == word[:-1]):
            banned.append(word[-1])
    return banned
