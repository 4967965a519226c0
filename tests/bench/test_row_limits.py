"""How many requests fill a row's decode batch, and which limit bounds that batch: the
model of the scheduler against the scheduler itself, and the request-count rule."""

from __future__ import annotations

import pytest

from bench.roofline import Roofline
from bench.row_limits import FILL, BatchLimits, batch_cap, budget_batch, kv_batch, mean_decode_batch, plan_requests
from worker.executor.block_manager import BlockManager
from worker.executor.scheduler import Scheduler
from worker.executor.sequence import Sequence
from worker.executor.types import ExecutorConfig, Request


def scheduled_mean_decode_batch(prompt: int, output: int, requests: int, limits: BatchLimits) -> float:
    """The real scheduler's mean decode batch: every step run as the executor runs it
    (computed tokens advance, a token is sampled where a sequence's tokens are all computed),
    and completed after the next one is scheduled, so a finished sequence leaves then."""
    config = ExecutorConfig(max_batch_size=limits.max_batch, max_num_tokens=limits.max_num_tokens)
    scheduler = Scheduler(config, BlockManager(limits.kv_tokens // limits.block_size, limits.block_size))
    for i in range(requests):
        request = Request(input_token_ids=[5] * prompt, max_tokens=output, end_id=-1)
        scheduler.add(Sequence(request_id=i, request=request, token_ids=[5] * prompt, num_prompt_tokens=prompt,
                               end_id=-1, stop_words=[], bad_words=[], seed=i,
                               sampling_params=(0.0, 0.0, 1.0, 0.0)))  # fmt: skip
    decoded, steps = 0, 0
    finished: list[Sequence] = []
    while scheduler.has_work:
        batch = scheduler.schedule()
        for seq in finished:
            scheduler.remove(seq)
        decoding = sum(1 for seq in batch.seqs if not seq.in_prefill)
        decoded, steps = decoded + decoding, steps + (decoding > 0)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed += n
            if seq.num_computed == seq.num_tokens:
                seq.token_ids.append(7)
        finished = [s for s in scheduler.running if s.num_generated == output]
    return decoded / steps


def one_second_steps() -> Roofline:
    """Every step reads the weights in exactly one second and nothing else costs anything."""
    return Roofline(bandwidth=1.0, flops=1e30, weight_bytes=1, matmul_params=1, lm_head_params=1,
                    kv_bytes_per_token=0, attn_flops_per_ctx=1)  # fmt: skip


@pytest.mark.parametrize(
    ("prompt", "output", "requests", "limits"),
    [
        (16, 16, 24, BatchLimits(max_batch=8, kv_tokens=4096, block_size=16, max_num_tokens=256)),  # batch cap
        (24, 10, 40, BatchLimits(max_batch=64, kv_tokens=320, block_size=8, max_num_tokens=64)),  # KV cache
        (48, 6, 60, BatchLimits(max_batch=64, kv_tokens=8192, block_size=16, max_num_tokens=64)),  # token budget
    ],
    ids=["max-batch", "kv-cache", "token-budget"],
)
def test_the_model_of_the_scheduler_decodes_the_batches_the_scheduler_does(prompt: int, output: int, requests: int,
                                                                            limits: BatchLimits) -> None:  # fmt: skip
    modelled = mean_decode_batch(prompt, output, requests, limits)
    assert modelled == pytest.approx(scheduled_mean_decode_batch(prompt, output, requests, limits), rel=1e-9)


def test_each_limit_is_named_where_it_binds() -> None:
    limits = BatchLimits(max_batch=8, kv_tokens=4096, block_size=16, max_num_tokens=256)
    assert batch_cap(16, 16, limits) == (8, "--max-batch")
    # 24 + 10 tokens take 5 blocks of 8; 40 blocks hold 8 such sequences
    assert kv_batch(24, 10, BatchLimits(64, 320, 8, 64)) == 8
    assert batch_cap(24, 10, BatchLimits(64, 320, 8, 64)) == (8, "KV cache")
    # each step decodes B and prefills 64 - B prompt tokens, which start (64 - B) / 48 requests that
    # decode for 5 steps each: B = 5 (64 - B) / 48, 6.04 sequences
    assert budget_batch(48, 6, 64) == 6
    assert batch_cap(48, 6, BatchLimits(64, 8192, 16, 64)) == (6, "token budget")


def test_a_long_run_decodes_the_batch_the_token_budget_sustains() -> None:
    limits = BatchLimits(max_batch=1024, kv_tokens=1 << 20, block_size=16, max_num_tokens=2048)
    assert budget_batch(512, 64, 2048) == 224
    assert mean_decode_batch(512, 64, 20_000, limits) == pytest.approx(224, rel=0.02)


def test_requests_are_the_fewest_whole_waves_that_fill_the_batch() -> None:
    # bound by the token budget: a wave ramps up and drains over a request's lifetime, so it takes several
    limits = BatchLimits(max_batch=64, kv_tokens=8192, block_size=16, max_num_tokens=64)
    plan = plan_requests(48, 6, limits, one_second_steps(), row_seconds=1e9)
    assert (plan.batch_cap, plan.bound) == (6, "token budget")
    assert plan.requests % 6 == 0 and plan.requests > 6
    assert mean_decode_batch(48, 6, plan.requests, limits) >= FILL * 6
    assert mean_decode_batch(48, 6, plan.requests - 6, limits) < FILL * 6
    assert plan.expected_batch == mean_decode_batch(48, 6, plan.requests, limits)


def test_a_least_row_time_adds_waves_to_a_filled_batch() -> None:
    # one wave of 8 fills the batch; on the roofline all prompts take one step, each wave 15
    # decode steps: 40 s take three waves (46 steps)
    limits = BatchLimits(max_batch=8, kv_tokens=4096, block_size=16, max_num_tokens=256)
    assert plan_requests(16, 16, limits, one_second_steps(), row_seconds=1e9).requests == 8
    plan = plan_requests(16, 16, limits, one_second_steps(), row_seconds=1e9, min_seconds=40)
    assert (plan.requests, plan.bound, plan.roofline_seconds) == (24, "--max-batch", 46)


def test_the_row_time_cuts_the_requests_and_says_so() -> None:
    # every token computes for one second: a request of 48 + 6 tokens costs 53 s (its last token is sampled only)
    token_seconds = Roofline(bandwidth=1e30, flops=2.0, weight_bytes=0, matmul_params=1, lm_head_params=0,
                             kv_bytes_per_token=0, attn_flops_per_ctx=0)  # fmt: skip
    limits = BatchLimits(max_batch=64, kv_tokens=8192, block_size=16, max_num_tokens=64)
    plan = plan_requests(48, 6, limits, token_seconds, row_seconds=53 * 13)
    assert (plan.requests, plan.bound, plan.roofline_seconds) == (12, "row time", 53 * 12)
    assert plan.expected_batch < FILL * plan.batch_cap
    # not one wave in the time: the requests that fit it
    short = plan_requests(48, 6, limits, token_seconds, row_seconds=53 * 4)
    assert (short.requests, short.bound) == (4, "row time")


def test_waves_in_step_stop_adding_waves_and_say_why() -> None:
    # 8 prompts of 16 take two 64-token steps to refill, after every wave has drained: each
    # wave decodes the same mean batch, short of the cap however many there are
    limits = BatchLimits(max_batch=8, kv_tokens=4096, block_size=16, max_num_tokens=64)
    assert mean_decode_batch(16, 16, 8, limits) == mean_decode_batch(16, 16, 80, limits) < FILL * 8
    plan = plan_requests(16, 16, limits, one_second_steps(), row_seconds=1e9)
    assert (plan.requests, plan.batch_cap, plan.bound) == (8, 8, "wave refill")


def test_a_request_the_cache_cannot_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="a request of 100\\+28 tokens does not fit a 64-token KV cache"):
        mean_decode_batch(100, 28, 4, BatchLimits(8, 64, 16, 256))
