"""The torch sampler applies the numpy reference's bias, penalties, bans and
grammar mask, so both backends pick the same tokens from the same logits; on a
GPU it queues its work without waiting for the device (overlapped scheduling
prepares the next step meanwhile)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dataclasses import replace  # noqa: E402

from worker.backends.base import SamplingBatch  # noqa: E402
from worker.backends.numpy_sampler import sample  # noqa: E402


def random_batch(rng: np.random.Generator, rows: int, vocab: int) -> SamplingBatch:
    seen_rows, seen_tokens, seen_counts = [], [], []
    for row in range(rows):
        tokens = rng.choice(vocab, size=int(rng.integers(0, 12)), replace=False)
        seen_rows += [row] * len(tokens)
        seen_tokens += tokens.tolist()
        seen_counts += rng.integers(0, 4, len(tokens)).tolist()
    masked = rng.choice(rows, size=rows // 3, replace=False)
    words = rng.integers(-(2**31), 2**31, size=(len(masked), -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    biased = rng.choice(rows, size=rows // 4, replace=False)
    return SamplingBatch(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7], rows).astype(np.float32),
        top_k=rng.choice([0, 1, 5, 40], rows).astype(np.int64),
        top_p=rng.choice([1.0, 0.9, 0.3], rows).astype(np.float32),
        min_p=rng.choice([0.0, 0.05], rows).astype(np.float32),
        uniform=rng.random(rows),
        ban_rows=np.array([0, 3], dtype=np.int64),
        ban_tokens=np.array([5, 7], dtype=np.int64),
        bias_rows=biased.astype(np.int64),
        bias=(rng.standard_normal((len(biased), vocab)) * 2).astype(np.float32),
        repetition_penalty=rng.choice([1.0, 1.3, 0.7], rows).astype(np.float32),
        presence_penalty=rng.choice([0.0, 0.5, -0.5], rows).astype(np.float32),
        frequency_penalty=rng.choice([0.0, 0.4], rows).astype(np.float32),
        seen_rows=np.array(seen_rows, dtype=np.int64),
        seen_tokens=np.array(seen_tokens, dtype=np.int64),
        seen_counts=np.array(seen_counts, dtype=np.int64),
        mask_rows=masked.astype(np.int64),
        token_mask=words,
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_processed_logits_and_tokens_match_the_numpy_reference(device: str) -> None:
    from worker.backends.torch_sampler import sample_tokens

    rng = np.random.default_rng(3)
    rows, vocab = 48, 300
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    sampling = random_batch(rng, rows, vocab)
    want = sample(logits, sampling)
    ids, log_probs = sample_tokens(torch.from_numpy(logits).to(device), sampling)
    np.testing.assert_array_equal(ids.cpu().numpy(), want.token_ids)
    np.testing.assert_allclose(log_probs.cpu().numpy(), want.log_probs, atol=1e-5)
    plain = sample(logits, SamplingBatch(sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                                         sampling.uniform, sampling.ban_rows, sampling.ban_tokens))
    assert (plain.token_ids != want.token_ids).sum() > rows // 4, "the new fields changed little: a weak test"


@pytest.mark.gpu
def test_sampling_on_the_gpu_never_waits_for_the_device() -> None:
    from worker.backends.torch_sampler import sample_all

    rng = np.random.default_rng(5)
    rows, vocab = 48, 300
    sampling = replace(random_batch(rng, rows, vocab), top_n=3)
    logits = torch.from_numpy((rng.standard_normal((rows, vocab)) * 3).astype(np.float32)).to("cuda")
    sample_all(logits, sampling)  # first use: allocations, kernel loading
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        ids, log_probs, top = sample_all(logits, sampling)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = sample(logits.cpu().numpy(), sampling)
    np.testing.assert_array_equal(ids.cpu().numpy(), want.token_ids)
    np.testing.assert_allclose(log_probs.cpu().numpy(), want.log_probs, atol=1e-5)
    assert top is not None and top[0].shape == (rows, 3)


def test_sampled_rows_in_chunks_pick_what_the_reference_picks() -> None:
    """More sampled rows than the sampler takes at once (its workspace bound): every
    chunk's rows pick the reference's tokens, the rows at chunk edges included."""
    from worker.backends.memory_plan import SAMPLE_CHUNK_ROWS
    from worker.backends.torch_sampler import sample_tokens

    rng = np.random.default_rng(11)
    rows, vocab = 2 * SAMPLE_CHUNK_ROWS + 7, 300
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    sampling = random_batch(rng, rows, vocab)
    sampling = replace(sampling, temperature=np.where(np.arange(rows) % 5 == 0, 0.0, 1.0).astype(np.float32))
    want = sample(logits, sampling)
    ids, log_probs = sample_tokens(torch.from_numpy(logits), sampling)
    np.testing.assert_array_equal(ids.numpy(), want.token_ids)
    np.testing.assert_allclose(log_probs.numpy(), want.log_probs, atol=1e-5)
    last_chunk = np.arange(2 * SAMPLE_CHUNK_ROWS, rows)
    assert (want.token_ids[last_chunk] != logits[last_chunk].argmax(axis=1)).any(), "the last chunk sampled nothing"


def test_the_warm_up_batch_takes_every_rule_of_the_sampler() -> None:
    """Start-up samples this batch so that no request pays for a kernel's first launch: every
    optional rule is on (a new SamplingBatch field left out fails here), a row is greedy and
    a row sampled with top-k, top-p and min-p, and it samples what the reference does."""
    from dataclasses import fields

    from worker.backends.torch_sampler import sample_all, warm_up_batch

    vocab = 300
    batch = warm_up_batch(vocab)
    for f in fields(SamplingBatch):
        value = getattr(batch, f.name)
        assert value is not None and np.size(value) > 0 and (f.name != "top_n" or value > 0), f.name
    greedy, sampled = batch.temperature == 0, batch.temperature > 0
    assert greedy.any() and sampled.any()
    assert (batch.top_k[sampled] > 0).all() and (batch.top_p[sampled] < 1).all() and (batch.min_p[sampled] > 0).all()
    logits = np.random.default_rng(2).standard_normal((2, vocab)).astype(np.float32)
    ids, _, top = sample_all(torch.from_numpy(logits), batch)
    np.testing.assert_array_equal(ids.numpy(), sample(logits, batch).token_ids)
    assert top is not None and top[0].shape == (2, 2)
