"""Whether a request fits its model: the prompt's token ids within the
vocabulary (and the rows of its prompt-tuning table), the prompt plus
max_tokens within the context.

The gateway applies these as soon as it knows which model serves a request,
so a bad one fails before it travels; the executor applies them again for
in-process callers. Both report the same words. Standard library only: the
executor imports this on a host without pydantic.
"""

from __future__ import annotations

from collections.abc import Iterable


def token_outside_vocabulary(token_ids: Iterable[int], vocab_size: int, table_rows: int = 0) -> str | None:
    """The error for the first prompt token id outside [0, vocab_size + table_rows)
    (ids past the vocabulary name rows of a prompt-tuning table); None when all fit."""
    limit = vocab_size + table_rows
    bad = next((t for t in token_ids if not 0 <= t < limit), None)
    if bad is None:
        return None
    if table_rows:
        return (f"input_token_ids: token id {bad} is outside the vocabulary and the prompt-tuning table "
                f"[0, {vocab_size} + {table_rows})")
    return f"input_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})"


def context_overflow(prompt_tokens: int, max_tokens: int, max_seq_len: int) -> str | None:
    """The error when the prompt and max_tokens together exceed the model's
    context; None when they fit."""
    if prompt_tokens + max_tokens <= max_seq_len:
        return None
    return (f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
            f"of {max_seq_len} tokens")
