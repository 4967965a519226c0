"""Prompt log probs (OutputConfig.prompt_log_probs): each prompt token's log prob
under the model, given the tokens before it, and the most likely tokens at its
position, as evaluation harnesses score a text (OpenAI's `echo` + `logprobs`,
vLLM's `prompt_logprobs`).

Computed from the context logits chunk by chunk as the prompt runs, so that a
request holds and sends a few numbers a token, never a row of the vocabulary.
The row at position j predicts token j + 1: the first prompt token has no log
prob, and the last prompt row predicts the first generated token (the ordinary
log probs' business), so a prompt of P tokens has P - 1 entries. Log probs are
the model's own (a log-softmax of the raw logits): no temperature, penalty or
bias applies to text that is given, not sampled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from worker.executor.types import PromptLogProbs

if TYPE_CHECKING:
    from worker.executor.sequence import Sequence


def wants_rows(seq: Sequence) -> bool:
    """Whether seq's prompt rows are collected (context logits or prompt log probs)."""
    out = seq.request.output_config
    return out.return_context_logits or out.prompt_log_probs is not None


def rows_collected(seq: Sequence) -> int:
    """How many of seq's prompt positions have had their row collected."""
    return max(len(seq.context_logits), 0 if seq.prompt_log_probs is None else seq.prompt_log_probs.rows)


def collect(seq: Sequence, logits: np.ndarray) -> None:
    """Take the logits [count, vocab] of seq's next `count` prompt positions (from
    rows_collected(seq) on): kept whole for context logits, reduced to log probs here."""
    out = seq.request.output_config
    first = rows_collected(seq)
    if out.return_context_logits:
        seq.context_logits.extend(logits.copy())
    k = out.prompt_log_probs
    if k is None:
        return
    acc = seq.prompt_log_probs = seq.prompt_log_probs or PromptLogProbs()
    # Row j scores token j + 1, which must still be a prompt token.
    targets = seq.token_ids[first + 1 : min(first + len(logits), seq.num_prompt_tokens - 1) + 1]
    acc.rows = first + len(logits)
    if not targets:
        return
    rows = np.asarray(logits[: len(targets)], dtype=np.float32)
    shifted = rows - rows.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    acc.log_probs += log_probs[np.arange(len(targets)), targets].tolist()
    if k == 0:
        acc.top_token_ids += [[] for _ in targets]
        acc.top_log_probs += [[] for _ in targets]
        return
    top = np.argpartition(-log_probs, k - 1, axis=1)[:, :k]
    top_lps = np.take_along_axis(log_probs, top, axis=1)
    order = np.argsort(-top_lps, axis=1, kind="stable")
    acc.top_token_ids += np.take_along_axis(top, order, axis=1).tolist()
    acc.top_log_probs += np.take_along_axis(top_lps, order, axis=1).tolist()


def result(seq: Sequence) -> PromptLogProbs | None:
    """What a final result carries: the leader's entries (the sequences of a request
    share its prompt, and only the leader computes it)."""
    if seq.request.output_config.prompt_log_probs is None or seq.sequence_index != 0:
        return None
    return seq.prompt_log_probs or PromptLogProbs()
