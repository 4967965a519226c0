"""What bounds an offline row's decode batch, and how many requests fill it.

Every request of a row has the same prompt and output length, all enqueued at once. The
decode batch can reach at most the smallest of three limits: the batch cap
(`--max-batch`), the sequences the KV cache holds at full length (the capacity scheduler's
GUARANTEED_NO_EVICT reserves that much for each), and the decode batch the per-step token
budget (`--max-num-tokens`) sustains while it also prefills the next prompts. Too few
requests leave it below that: a run of one wave of 256 sequences cannot show what 800
at once do. `plan_requests` takes the fewest whole waves whose mean decode batch,
in a model of the scheduler (worker/executor/scheduler.py), comes within FILL of the
limit, as long as the row's roofline time stays within the time given it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from bench.roofline import Roofline

# The mean decode batch a planned row reaches, at least, as a share of its limit.
FILL = 0.9
# Waves a row may take before the time budget alone decides: a row bound by the token
# budget (long prompts, short outputs) ramps up and drains over one request's lifetime.
MAX_WAVES = 64
# What another wave must add to the mean decode batch, as a share of the cap, to be worth running.
PLATEAU = 0.005


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The engine's limits as the executor was built: `kv_tokens` what the cache holds."""

    max_batch: int
    kv_tokens: int
    block_size: int
    max_num_tokens: int


@dataclass(frozen=True, slots=True)
class RequestPlan:
    requests: int
    batch_cap: int  # the decode batch the limits allow
    # which limit that is: "--max-batch", "KV cache", "token budget"; or what kept the batch
    # short of it: "row time" (the time budget), "wave refill" (waves in step: plan_requests)
    bound: str
    expected_batch: float  # the modelled mean decode batch at `requests`
    roofline_seconds: float  # the row's time at its roofline (it takes longer by 1 / its share of it)


def kv_batch(prompt: int, output: int, limits: BatchLimits) -> int:
    """Sequences the KV cache holds at full length, in whole blocks."""
    blocks = -(-(prompt + output) // limits.block_size)
    return limits.kv_tokens // limits.block_size // blocks


def budget_batch(prompt: int, output: int, max_num_tokens: int) -> int:
    """The decode batch a step's token budget sustains in the steady state: each step decodes
    B sequences and prefills (budget - B) prompt tokens, so (budget - B) / prompt requests
    start a step and each decodes for output - 1 steps: B = (output - 1) (budget - B) / prompt."""
    return (output - 1) * max_num_tokens // (prompt + output - 1)


def batch_cap(prompt: int, output: int, limits: BatchLimits) -> tuple[int, str]:
    """The decode batch the limits allow, and which of them it is (the first, on a tie)."""
    caps = [(limits.max_batch, "--max-batch"), (kv_batch(prompt, output, limits), "KV cache"),
            (budget_batch(prompt, output, limits.max_num_tokens), "token budget")]  # fmt: skip
    return min(caps, key=lambda c: c[0])


def mean_decode_batch(prompt: int, output: int, requests: int, limits: BatchLimits) -> float:
    """The mean decode batch over the steps that decode, in a model of the scheduler under
    GUARANTEED_NO_EVICT with chunked prefill: each step decodes every sequence past its
    prefill, then continues the one prompt left part-done, then admits waiting requests
    while the budget, the batch cap and the cache allow; a sequence leaves the step after
    the one that decodes its last token. Identical requests move in cohorts (those whose
    prefill ends in the same step), so a step costs O(1)."""
    running_cap = min(limits.max_batch, kv_batch(prompt, output, limits))
    if running_cap < 1:
        raise ValueError(f"a request of {prompt}+{output} tokens does not fit a {limits.kv_tokens}-token KV cache")
    waiting, running, partial, leaving = requests, 0, 0, 0
    cohorts: deque[list[int]] = deque()  # [the step that decodes its last token, sequences]
    decoding = step = decode_steps = decoded = 0
    while waiting or running:
        step += 1
        budget = limits.max_num_tokens - min(decoding, limits.max_num_tokens)
        if decoding:
            decode_steps += 1
            decoded += decoding
        prefilled = 0
        if partial:
            chunk = min(partial, budget)
            partial, budget = partial - chunk, budget - chunk
            prefilled += partial == 0
        if budget and waiting and running < running_cap and not partial:
            whole = min(waiting, running_cap - running, budget // prompt)
            running, waiting, prefilled = running + whole, waiting - whole, prefilled + whole
            budget -= whole * prompt
            if budget and waiting and running < running_cap:  # a prompt that starts now and ends in a later step
                running, waiting, partial = running + 1, waiting - 1, prompt - budget
        # The engine completes a step after launching the next (worker/executor/engine_core.py):
        # a sequence leaves the batch one step after the one that sampled its last token.
        running, leaving = running - leaving, 0
        while cohorts and cohorts[0][0] == step:
            finished = cohorts.popleft()[1]
            decoding, leaving = decoding - finished, leaving + finished
        if prefilled and output == 1:
            leaving += prefilled  # its prefill sampled its only token
        elif prefilled:  # they decode from the next step on
            cohorts.append([step + output - 1, prefilled])
            decoding += prefilled
    return decoded / decode_steps if decode_steps else math.nan


def plan_requests(prompt: int, output: int, limits: BatchLimits, roof: Roofline, row_seconds: float,
                  min_seconds: float = 0.0) -> RequestPlan:  # fmt: skip
    """The fewest whole waves of the batch cap whose modelled mean decode batch is within FILL
    of the cap and whose roofline time (the guaranteed schedule's) is at least `min_seconds`
    (a short run times its ramp and drain as much as its steady state). Where that would
    pass `row_seconds`, the most whole waves within it (or, short of one wave, the requests
    that fit it), and the bound is "row time" unless the batch is filled all the same. Where
    another wave adds less than PLATEAU of the cap to a batch the cap or the cache bounds,
    the waves run in step, each refilling the batch only after the one before has drained:
    more would not fill it, and the bound is "wave refill". (Under the token budget the
    batch nears its cap slowly, as ramp and drain become a smaller share of the run.)"""
    cap, bound = batch_cap(prompt, output, limits)
    cap = max(cap, 1)
    chosen, batch, previous = 0, 0.0, 0.0
    for waves in range(1, MAX_WAVES + 1):
        n = waves * cap
        if seconds(roof, prompt, output, n, limits) > row_seconds:
            break
        chosen, batch = n, mean_decode_batch(prompt, output, n, limits)
        filled = batch >= FILL * cap
        if filled and seconds(roof, prompt, output, n, limits) >= min_seconds:
            break
        if not filled and waves > 1 and bound != "token budget" and batch - previous < PLATEAU * cap:
            return replace(plan_at(prompt, output, n - cap, limits, roof, ""), bound="wave refill")
        previous = batch
    if not chosen:
        chosen = max(1, min(cap, int(row_seconds / (seconds(roof, prompt, output, cap, limits) / cap))))
    return plan_at(prompt, output, chosen, limits, roof, "row time")


def plan_at(prompt: int, output: int, requests: int, limits: BatchLimits, roof: Roofline, short: str) -> RequestPlan:
    """The plan of `requests` requests: the cap's bound, or `short` (what chose the count)
    where the modelled mean decode batch falls short of FILL of the cap."""
    cap, bound = batch_cap(prompt, output, limits)
    batch = mean_decode_batch(prompt, output, requests, limits)
    return RequestPlan(requests, cap, bound if batch >= FILL * max(cap, 1) else short, batch,
                       seconds(roof, prompt, output, requests, limits))  # fmt: skip


def seconds(roof: Roofline, prompt: int, output: int, requests: int, limits: BatchLimits) -> float:
    """A row's time at its roofline, the guaranteed schedule's."""
    tok_s = roof.for_schedule(prompt, output, requests, limits.max_batch, limits.kv_tokens, "guaranteed_no_evict")
    return requests * output / tok_s


def decode_resource(roof: Roofline, prompt: int, output: int, batch: int) -> str:
    """What bounds a decode step of `batch` sequences at mid-generation on the roofline:
    "HBM" (weights and KV bytes at the copy bandwidth) or "GEMM" (its FLOPs at the GEMM rate)."""
    context = prompt + output // 2
    keys, window_keys = batch * context, batch * roof.clipped(context)
    step = (batch, batch, keys, keys, window_keys, window_keys)
    compute = replace(roof, bandwidth=math.inf).step_floor(*step)
    memory = replace(roof, flops=math.inf).step_floor(*step)
    return "GEMM" if compute > memory else "HBM"
