"""A step cut into micro-batches: contiguous runs of sequences with every array sliced
alike, cut where the tokens come out most even; each run as a step of its own gives
the whole step's logits rows (the numpy backend as the reference)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.worker.backends.paged_batches import PagedSequences
from worker.backends.base import ForwardBatch
from worker.backends.numpy_backend import NumpyBackend
from worker.models.loader import load_model
from worker.parallel.micro_batches import split


def _steps() -> tuple[ForwardBatch, ForwardBatch]:
    """Three prompts; then a 10-token prefill chunk (no logits row), a 6-token prompt,
    and the three sequences' next tokens."""
    rng = np.random.default_rng(1)
    prompts = {name: rng.integers(0, 300, 20).tolist() for name in "abcde"}
    paged = PagedSequences(num_blocks=64, block_size=4, seed=2)
    first = paged.step([("c", prompts["c"], 0, 7), ("d", prompts["d"], 0, 5), ("e", prompts["e"], 0, 9)])
    parts = [("a", prompts["a"], 0, 10), ("b", prompts["b"], 0, 6), ("c", prompts["c"], 7, 1),
             ("d", prompts["d"], 5, 1), ("e", prompts["e"], 9, 1)]  # fmt: skip
    step = paged.step(parts, all_logits=False)
    return first, replace(step, logits_indices=step.logits_indices[1:])  # a's chunk is not its prompt's end


def _mixed_step() -> ForwardBatch:
    return _steps()[1]


def test_cuts_fall_where_the_tokens_are_even_and_every_array_is_sliced_alike() -> None:
    step = _mixed_step()
    parts = split(step, 2)
    assert [p.batch.num_seqs for p in parts] == [1, 4]  # 10 tokens | 9: the nearest even cut
    assert [p.batch.num_tokens for p in parts] == [10, 9]
    assert parts[0].batch.logits_indices.shape == (0,) and parts[0].rows.shape == (0,)
    t0 = 0
    for p in parts:
        b = p.batch
        first = int(np.searchsorted(step.query_start, t0))
        np.testing.assert_array_equal(b.query_start, step.query_start[first : first + b.num_seqs + 1] - t0)
        np.testing.assert_array_equal(b.context_lens, step.context_lens[first : first + b.num_seqs])
        np.testing.assert_array_equal(b.block_tables, step.block_tables[first : first + b.num_seqs])
        np.testing.assert_array_equal(b.token_ids, step.token_ids[t0 : t0 + b.num_tokens])
        np.testing.assert_array_equal(b.slot_mapping, step.slot_mapping[t0 : t0 + b.num_tokens])
        np.testing.assert_array_equal(b.logits_indices + t0, step.logits_indices[p.rows])
        t0 += b.num_tokens
    assert [p.batch.num_seqs for p in split(step, 3)] == [1, 1, 3]
    assert [p.batch.num_seqs for p in split(step, 9)] == [1] * 5  # no more micro-batches than sequences
    (whole,) = split(step, 1)
    assert whole.batch is step


def test_prompt_rows_and_lora_slots_go_with_their_tokens() -> None:
    step = _mixed_step()
    embeds = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)
    step = replace(step, prompt_rows=np.array([2, 12, 18]), prompt_embeds=embeds, lora_slots=np.arange(19))
    first, second = split(step, 2)
    np.testing.assert_array_equal(first.batch.prompt_rows, [2])
    np.testing.assert_array_equal(first.batch.prompt_embeds, embeds[:1])
    np.testing.assert_array_equal(second.batch.prompt_rows, [2, 8])
    np.testing.assert_array_equal(second.batch.prompt_embeds, embeds[1:])
    np.testing.assert_array_equal(second.batch.lora_slots, np.arange(10, 19))


@pytest.mark.parametrize("count", [2, 3, 5])
def test_the_micro_batches_run_one_by_one_give_the_steps_logits(count: int, tiny_llama: Path) -> None:
    model = load_model(tiny_llama)
    prefill, step = _steps()
    # The logits rows in another order than their sequences': each still finds its place.
    step = replace(step, logits_indices=step.logits_indices[::-1].copy())
    whole, parted = NumpyBackend(model), NumpyBackend(model)
    for b in (whole, parted):
        b.allocate_kv_cache(num_blocks=64, block_size=4)
        b.forward(prefill)
    want = whole.forward(step)
    got = np.empty_like(want)
    for part in split(step, count):
        got[part.rows] = parted.forward(part.batch)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
