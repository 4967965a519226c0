"""The step inputs: the generation fast path builds what the general path builds,
and sampling rows draw the uniform numbers of their own output positions."""

from __future__ import annotations

import random

import numpy as np
import pytest

from worker.executor.block_manager import BlockTable
from worker.executor.inputs import (
    build_forward_batch,
    build_sampling_batch,
    generation_forward_batch,
    packed_forward_batch,
    uniform_draws,
)
from worker.executor.scheduler import ScheduledBatch
from worker.executor.sequence import Sequence
from worker.executor.types import Request, SamplingConfig


def sequence(rng: random.Random, i: int, temperature: float = 0.0, bad_words: list[list[int]] | None = None,
             block_size: int = 4) -> Sequence:
    """A sequence in generation: all but its last token computed, blocks for them and a few drafts more."""
    length = rng.randint(2, 40)
    tokens = [rng.randrange(100) for _ in range(length)]
    if rng.random() < 0.3:
        tokens[-1] = -(i + 1)  # a placeholder of the step in flight
    seq = Sequence(request_id=i, request=Request(input_token_ids=tokens[:1], max_tokens=64,
                                                 sampling_config=SamplingConfig(seed=i)),
                   token_ids=tokens, num_prompt_tokens=1, end_id=-1, stop_words=[], bad_words=bad_words or [],
                   seed=100 + i, sampling_params=(temperature, 0.0, 1.0, 0.0), sequence_index=i % 2)
    seq.num_computed = length - 1
    seq.blocks = BlockTable(rng.sample(range(1000), -(-(length + 8) // block_size)))
    return seq


@pytest.mark.parametrize("seed", range(20))
def test_generation_fast_path_builds_what_the_general_path_builds(seed: int) -> None:
    rng = random.Random(seed)
    batch = ScheduledBatch()
    rows = []
    for i in range(rng.randint(1, 9)):
        drafts = [rng.randrange(100) for _ in range(rng.choice([0, 0, 1, 4, 8]))]
        batch.add(sequence(rng, i), 1 + len(drafts), drafts)
        rows.append(len(drafts) + 1 if drafts else rng.choice([1, 1, 3]))
    for given in (None, rows):
        fast = generation_forward_batch(batch, 4, given)
        general = packed_forward_batch(batch, 4, given)
        for name in ("token_ids", "positions", "query_start", "context_lens", "block_tables", "slot_mapping",
                     "logits_indices"):
            a, b = getattr(fast, name), getattr(general, name)
            assert a.dtype == b.dtype == np.int64, name
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_verification_step_and_a_context_chunk_feed_their_own_tokens() -> None:
    rng = random.Random(0)
    seq = sequence(rng, 0)
    batch = ScheduledBatch()
    batch.add(seq, 3, [5, 6])
    assert build_forward_batch(batch, 4).token_ids.tolist() == [seq.token_ids[-1], 5, 6]
    # A chunk of more than the last token is a context step (the general path).
    seq.num_computed -= 2
    chunk = ScheduledBatch()
    chunk.add(seq, 3)
    out = build_forward_batch(chunk, 4)
    assert out.token_ids.tolist() == seq.token_ids[-3:]
    assert out.logits_indices.tolist() == [2]


def test_rows_draw_their_own_output_positions_and_greedy_rows_draw_nothing() -> None:
    rng = random.Random(1)
    sampled = sequence(rng, 0, temperature=0.8)
    greedy = sequence(rng, 1)
    banned = sequence(rng, 2, temperature=1.0, bad_words=[[7], [8]])
    seqs = [sampled] * 3 + [greedy] * 2 + [banned] * 2
    offsets = [0, 1, 2, 0, 1, 0, 1]
    out = build_sampling_batch(seqs, offsets)
    want = uniform_draws(np.array([s.seed for s in seqs], dtype=np.uint64),
                         np.array([s.sequence_index for s in seqs], dtype=np.uint64),
                         np.array([s.num_generated + o for s, o in zip(seqs, offsets, strict=True)],
                                  dtype=np.uint64))
    sampled_rows = [0, 1, 2, 5, 6]
    np.testing.assert_array_equal(out.uniform[sampled_rows], want[sampled_rows])
    assert len(set(out.uniform[sampled_rows].tolist())) == 5
    assert out.uniform[[3, 4]].tolist() == [0.0, 0.0]
    assert out.temperature.tolist() == pytest.approx([0.8] * 3 + [0.0] * 2 + [1.0] * 2)
    assert list(zip(out.ban_rows.tolist(), out.ban_tokens.tolist(), strict=True)) == [(5, 7), (5, 8), (6, 7), (6, 8)]
    # The same rows without offsets (ordinary decoding) draw the next position's number.
    plain = build_sampling_batch([sampled, greedy])
    assert plain.uniform.tolist() == [want[0], 0.0]
