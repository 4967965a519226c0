"""Starting a continuation (protocol/continuation.py): a sequence that begins with
the output tokens an earlier run of its request already delivered.

They are placed as generated tokens, so everything that counts or reads the
output (max_tokens, min_tokens, penalties, stop words, the sampler's per-step
draws, speculation's context) goes on from where the earlier run stopped; the
prefill computes them with the prompt, and nothing is sent for them again."""

from __future__ import annotations

from worker.executor.sequence import Sequence
from worker.executor.validation import RequestError


def resume(seq: Sequence, resumed: list[int]) -> None:
    """Place the delivered tokens after the prompt; replay them through the grammar."""
    seq.token_ids.extend(resumed)
    seq.num_emitted = len(resumed)
    # Continuations return no log probs (not_resumable), but the list lines up with the output.
    seq.log_probs.extend([0.0] * len(resumed))
    if seq.matcher is not None:
        for i, token in enumerate(resumed):
            if not seq.matcher.accept(token) or (seq.matcher.is_terminated and i < len(resumed) - 1):
                raise RequestError(f"resumed_token_ids[{i}] (token {token}) is not accepted by the request's grammar")
