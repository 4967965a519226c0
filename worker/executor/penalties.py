"""Per-sequence inputs to the sampler's penalties and bans, computed on the host
from the tokens a sequence has so far (the sampler applies them, batched)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from worker.executor.sequence import Sequence
from worker.executor.types import SamplingConfig


def uses_penalties(cfg: SamplingConfig) -> bool:
    return (
        (cfg.repetition_penalty is not None and cfg.repetition_penalty != 1.0)
        or bool(cfg.presence_penalty)
        or bool(cfg.frequency_penalty)
    )


def needs_known_tokens(seq: Sequence) -> bool:
    """Whether building this sequence's sampling inputs reads its latest token,
    so a step cannot be prepared while that token is still being sampled."""
    cfg = seq.request.sampling_config
    return (
        any(len(w) > 1 for w in seq.bad_words)
        or bool(cfg.no_repeat_ngram_size)
        or uses_penalties(cfg)
        or (cfg.top_p_decay is not None and cfg.top_p_reset_ids is not None)
        or seq.matcher is not None
    )


def seen_tokens(seq: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """(token ids in the prompt or generated, how often each was generated)."""
    tokens = np.asarray(seq.token_ids[: seq.num_known], dtype=np.int64)
    ids, inverse = np.unique(tokens, return_inverse=True)
    generated = np.zeros(len(ids), dtype=np.int64)
    np.add.at(generated, inverse[seq.num_prompt_tokens :], 1)
    return ids, generated


def no_repeat_ngram_bans(tokens: list[int], n: int) -> list[int]:
    """Tokens that would complete an n-gram already present in `tokens` (the
    prompt counts, as in transformers' NoRepeatNGramLogitsProcessor)."""
    if n < 1 or len(tokens) + 1 < n:
        return []
    if n == 1:
        return sorted(set(tokens))
    arr = np.asarray(tokens, dtype=np.int64)
    grams = sliding_window_view(arr, n)
    prefix = arr[len(arr) - (n - 1) :]
    hits = (grams[:, :-1] == prefix).all(axis=1)
    return np.unique(grams[hits, -1]).tolist()


def banned_tokens(seq: Sequence) -> list[int]:
    """The end token before min_tokens, the last token of any bad word whose
    prefix the sequence just produced, and no-repeat n-gram completions."""
    banned: list[int] = []
    cfg = seq.request.sampling_config
    if seq.end_id >= 0 and seq.num_generated < (cfg.min_tokens or 0):
        banned.append(seq.end_id)
    tokens = seq.token_ids
    for word in seq.bad_words:
        k = len(word) - 1
        if k == 0 or (k <= len(tokens) and tokens[len(tokens) - k :] == word[:-1]):
            banned.append(word[-1])
    if cfg.no_repeat_ngram_size:
        banned += no_repeat_ngram_bans(tokens, cfg.no_repeat_ngram_size)
    return banned


def decayed_top_p(seq: Sequence, top_p: float) -> float:
    """Top-p with decay (Lee et al., "Factuality Enhanced Language Models"): after
    k tokens since the start or the last reset token, max(top_p_min, top_p * decay^k)."""
    cfg = seq.request.sampling_config
    if cfg.top_p_decay is None or top_p >= 1.0:
        return top_p
    generated = seq.token_ids[seq.num_prompt_tokens :]
    k = len(generated)
    if cfg.top_p_reset_ids is not None and cfg.top_p_reset_ids in generated:
        k = len(generated) - 1 - max(i for i, t in enumerate(generated) if t == cfg.top_p_reset_ids)
    floor = 1e-6 if cfg.top_p_min is None else cfg.top_p_min
    return max(floor, top_p * cfg.top_p_decay**k)
