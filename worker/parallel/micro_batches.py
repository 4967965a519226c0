"""A step's packed batch cut into micro-batches, so pipeline stages overlap: while stage
s runs micro-batch i, stage s + 1 runs i - 1.

A micro-batch is a contiguous run of the step's sequences (attention never crosses
sequences, so each runs as a step of its own), cut where the token counts come out
most even. Every per-token and per-sequence array is sliced alike; placeholder token
ids (-(k + 1): row k of the previous step's samples) keep their meaning.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from worker.backends.base import ForwardBatch


@dataclass(frozen=True, slots=True)
class MicroBatch:
    batch: ForwardBatch
    rows: np.ndarray  # int64 [S_i]: where its logits rows sit among the whole step's


def split(batch: ForwardBatch, count: int) -> list[MicroBatch]:
    """At most `count` micro-batches (fewer when the step has fewer sequences), in order."""
    bounds = _bounds(batch.query_start, min(count, batch.num_seqs))
    if len(bounds) == 2:  # one: the step as it is
        return [MicroBatch(batch, np.arange(batch.logits_indices.shape[0], dtype=np.int64))]
    return [_slice(batch, int(a), int(b)) for a, b in itertools.pairwise(bounds)]


def _bounds(query_start: np.ndarray, count: int) -> np.ndarray:
    """Sequence indices [0, c_1, ..., B]: each cut is the sequence boundary nearest to an
    even share of the tokens, with at least one sequence on either side of it."""
    num_seqs = query_start.shape[0] - 1
    cuts = [0]
    for k in range(1, count):
        target = query_start[-1] * k / count
        lo, hi = cuts[-1] + 1, num_seqs - (count - k)
        cuts.append(lo + int(np.abs(query_start[lo : hi + 1] - target).argmin()))
    return np.array([*cuts, num_seqs], dtype=np.int64)


def _slice(batch: ForwardBatch, a: int, b: int) -> MicroBatch:
    """Sequences [a, b) of the step, as a step of their own."""
    t0, t1 = int(batch.query_start[a]), int(batch.query_start[b])
    wanted = (batch.logits_indices >= t0) & (batch.logits_indices < t1)
    prompt_rows = prompt_embeds = None
    if batch.prompt_rows is not None:
        mine = (batch.prompt_rows >= t0) & (batch.prompt_rows < t1)
        if mine.any():
            assert batch.prompt_embeds is not None
            prompt_rows, prompt_embeds = batch.prompt_rows[mine] - t0, batch.prompt_embeds[mine]
    part = ForwardBatch(
        token_ids=batch.token_ids[t0:t1],
        positions=batch.positions[t0:t1],
        query_start=batch.query_start[a : b + 1] - t0,
        context_lens=batch.context_lens[a:b],
        block_tables=batch.block_tables[a:b],
        slot_mapping=batch.slot_mapping[t0:t1],
        logits_indices=batch.logits_indices[wanted] - t0,
        lora_slots=None if batch.lora_slots is None else batch.lora_slots[t0:t1],
        prompt_rows=prompt_rows,
        prompt_embeds=prompt_embeds,
    )
    return MicroBatch(part, np.flatnonzero(wanted).astype(np.int64))
