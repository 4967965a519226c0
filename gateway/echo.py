"""A completion's prompt in its response: OpenAI's `echo` (the prompt's text before
each choice's, and with `logprobs` the prompt's tokens before the generated ones)
and vLLM's `prompt_logprobs`, as evaluation harnesses ask for them to score a
text (lm-evaluation-harness: `echo`, `logprobs`, `max_tokens` 0 or 1).

The log probs come from the worker (protocol.PromptLogProbs: a few numbers a
token); the first prompt token has none, as in OpenAI's and vLLM's answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import protocol

# (token id, its log prob, the likeliest tokens there with theirs): None where a token has none.
Entry = tuple[int, float | None, list[tuple[int, float]] | None]


@dataclass(frozen=True, slots=True)
class Echo:
    """What a completion's choices repeat of their prompt."""

    text: str | None  # None: the text is not echoed
    token_ids: list[int]
    with_log_probs: bool  # `logprobs` asked: the prompt's tokens lead each choice's
    prompt_logprobs: bool  # vLLM's `prompt_logprobs` asked


def prompt_entries(token_ids: list[int], lps: protocol.PromptLogProbs | None) -> list[Entry]:
    """The prompt's tokens as log prob entries: the first without, each other with its own."""
    if not token_ids:
        return []
    if lps is None or len(lps.log_probs) != len(token_ids) - 1:
        raise ValueError("the worker returned no prompt log probs for this prompt")
    tops = zip(lps.top_token_ids, lps.top_log_probs, strict=True)
    rest: list[Entry] = [(t, lp, list(zip(ids, top, strict=True)))
                         for t, lp, (ids, top) in zip(token_ids[1:], lps.log_probs, tops, strict=True)]  # fmt: skip
    return [(token_ids[0], None, None), *rest]


def vllm_prompt_logprobs(entries: list[Entry], text: Any) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id ->
    {logprob, decoded_token} for the token itself and the likeliest ones there."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token, lp, top in entries:
        if lp is None:
            out.append(None)
            continue
        one = {str(token): {"logprob": lp, "decoded_token": text(token)}}
        for t, tlp in top or []:
            one.setdefault(str(t), {"logprob": tlp, "decoded_token": text(t)})
        out.append(one)
    return out
