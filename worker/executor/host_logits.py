"""A step whose logits come to the host: the requests' logits post-processors,
sampling there, context and generation logits, and normalized log probs.

Only steps with a request that asks for one of these take this path (the
launcher's `on_host`); every other step samples on the device."""

from __future__ import annotations

from typing import Any

import numpy as np

from worker.backends.base import SampleOutput, SamplingBatch
from worker.backends.numpy_sampler import process_logits
from worker.backends.numpy_sampler import sample as sample_on_host
from worker.executor import prompt_log_probs
from worker.executor.log_probs import normalized_log_probs
from worker.executor.logits_processors import apply_processors
from worker.executor.sequence import Sequence


def wants_host_logits(seq: Sequence, normalize_log_probs: bool) -> bool:
    """Post-processors, generation logits and normalized log probs need the logits on the host."""
    request = seq.request
    return (request.logits_post_processor_name is not None or request.output_config.return_generation_logits
            or (normalize_log_probs and normalizes(seq)))


def normalizes(seq: Sequence) -> bool:
    """Whether seq's log probs are renormalized (ExecutorConfig.normalize_log_probs); beams keep theirs."""
    return seq.request.output_config.return_log_probs and not (seq.family is not None and seq.family.is_beam)


def context_rows(seq: Sequence, n: int) -> tuple[int, int] | None:
    """(first position, count) of this chunk's prompt tokens whose context logits (or
    prompt log probs) are still to collect, if the request asked for them."""
    if not prompt_log_probs.wants_rows(seq):
        return None
    lo = max(seq.num_computed, prompt_log_probs.rows_collected(seq))
    hi = min(seq.num_computed + n, seq.num_prompt_tokens)
    return (lo, hi - lo) if hi > lo else None


def sample(logits: np.ndarray, sampling: SamplingBatch | None, samplers: list[Sequence],
           extra: list[tuple[Sequence, int, int]], processors: dict[str, Any], normalize_log_probs: bool,
           errors: dict[int, str]) -> SampleOutput | None:
    """Keep the logits the requests asked for, run their post-processors and sample.
    `logits`: [sampler rows, then each `extra` sequence's context rows, vocab];
    a post-processor's failure lands in `errors` (request id -> message)."""
    # The context rows follow the sampling rows, each sequence's in the order of `extra`.
    at = len(samplers)
    for seq, _, count in extra:
        prompt_log_probs.collect(seq, logits[at : at + count])
        at += count
    if sampling is None:
        return None
    rows = np.array(logits[: len(samplers)], dtype=np.float32)
    for row, seq in enumerate(samplers):
        if seq.request.output_config.return_generation_logits:
            seq.generation_logits.append(rows[row].copy())
    # A post-processor sees one request at a time: a beam search's beams together
    # ([beam_width, vocab] and every beam's tokens), any other sequence alone.
    groups: dict[object, list[int]] = {}
    for r, seq in enumerate(samplers):
        if seq.request.logits_post_processor_name is not None:
            beam = seq.family is not None and seq.family.is_beam
            groups.setdefault(seq.request_id if beam else (seq.request_id, r), []).append(r)
    picked = list(groups.values())
    if picked:
        new, failed = apply_processors(processors, [
            (samplers[g[0]].request_id, samplers[g[0]].request.logits_post_processor_name or "", rows[g],
             [samplers[r].token_ids[: samplers[r].num_known] for r in g], samplers[g[0]].request.client_id)
            for g in picked
        ])
        for k, g in enumerate(picked):
            rows[g] = new[k]
        for k, message in failed.items():
            errors[samplers[picked[k][0]].request_id] = message
    out = sample_on_host(rows, sampling)
    if normalize_log_probs:
        renormalized = [r for r, seq in enumerate(samplers) if normalizes(seq)]
        if renormalized:
            params = np.array([samplers[r].sampling_params for r in renormalized], dtype=np.float64)
            processed = process_logits(rows, sampling)[renormalized]  # what the sampler picked from
            out.log_probs[renormalized] = normalized_log_probs(processed, out.token_ids[renormalized], params)
    return out
