"""Which started requests can continue elsewhere, and how a continuation is checked.

A continuation is a request sent again with the output tokens its reader already
received (`resumed_token_ids`): the worker computes them as context, counts them as
generated (max_tokens, min_tokens, penalties, stop words, the sampler's step, a
grammar's state) and generates from the position after them. Streamed, it sends
nothing for them again; not streamed, its one result holds the whole output, as the
first run's would have. A gateway sends one when a started request's worker is lost
(request migration); a client sends one through another gateway when its gateway is
lost.

The rule is here, pure data and no imports of ours, because the gateway, the client
and the executor apply the same one: a `Submit` and the executor's `Request` have
the same field names.
"""

from __future__ import annotations

from typing import Any


def not_resumable(request: Any) -> str | None:
    """Why a started request cannot continue as a continuation (None: it can).

    A continuation reproduces the generated tokens and their text. What it cannot
    reproduce is what the first run sent beside them: other beams or sequences, per
    token log probs and logits (the continuation has not computed them for the
    tokens it resumes), outputs that repeat the prompt or every token so far."""
    out = request.output_config
    reasons = (
        (request.sampling_config.beam_width > 1, "beam search"),
        (request.num_return_sequences > 1, "more than one returned sequence"),
        (out.return_log_probs, "output_config.return_log_probs"),
        (out.top_n_log_probs > 0, "output_config.top_n_log_probs"),
        (out.return_context_logits, "output_config.return_context_logits"),
        (out.return_generation_logits, "output_config.return_generation_logits"),
        (out.prompt_log_probs is not None, "output_config.prompt_log_probs"),
        (not out.exclude_input_from_output, "outputs that repeat the prompt (exclude_input_from_output off)"),
        (request.return_all_generated_tokens, "return_all_generated_tokens"),
    )
    return next((why for used, why in reasons if used), None)


def continuation_problem(request: Any, vocab_size: int | None) -> str | None:
    """What is wrong with a request's `resumed_token_ids` (None: nothing, or none given);
    the vocabulary is checked where it is known."""
    resumed = request.resumed_token_ids
    if resumed is None:
        return None
    why = not_resumable(request)
    if why is not None:
        return f"resumed_token_ids: a request with {why} cannot be continued"
    if len(resumed) >= request.max_tokens:
        return (f"resumed_token_ids holds {len(resumed)} tokens; max_tokens ({request.max_tokens}) leaves none "
                "to generate")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in resumed):
        return f"resumed_token_ids: a token id outside the vocabulary [0, {vocab_size})"
    return None
