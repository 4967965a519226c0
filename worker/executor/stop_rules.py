"""When a sequence ends: the stop rules, checked on the host after each token is
in place (completion.py for sampled tokens, speculative.py for verified ones)."""

from __future__ import annotations

from worker.executor.sequence import Sequence
from worker.executor.types import FinishReason


def finish_reason(seq: Sequence, length: int, max_seq_len: int) -> FinishReason:
    """Why the sequence ends at token_ids[:length], if it does (NOT_FINISHED: it goes on)."""
    tokens = seq.token_ids
    if tokens[length - 1] == seq.end_id:
        return FinishReason.END_ID
    if seq.matcher is not None and (not seq.matcher.accept(tokens[length - 1]) or seq.matcher.is_terminated):
        # The grammar is complete (it accepted a stop token) or, with no end
        # token to stop on, can take nothing more.
        return FinishReason.END_ID
    generated = length - seq.num_prompt_tokens
    for word in seq.stop_words:
        if len(word) <= generated and tokens[length - len(word) : length] == word:
            return FinishReason.STOP_WORDS
    if generated >= seq.request.max_tokens or length >= max_seq_len:
        return FinishReason.LENGTH
    return FinishReason.NOT_FINISHED
