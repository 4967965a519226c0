"""Normalized log probs (ExecutorConfig.normalize_log_probs): a sampled token's
log prob over the tokens its sampling could have picked, as TensorRT-LLM's
samplers report them by default (log P(token | token in the top-k / top-p set)),
instead of over the whole vocabulary. The kept set is the numpy sampler's own:
the processed logits at the row's temperature, then top-k, top-p and min-p."""

from __future__ import annotations

import numpy as np

from worker.backends.numpy_sampler import _top_k_top_p


def normalized_log_probs(logits: np.ndarray, tokens: np.ndarray, params: np.ndarray) -> np.ndarray:
    """float32 [n]. logits: processed, [n, vocab]; params: [n, 4] rows of
    (temperature, top_k, top_p, min_p) as Sequence.sampling_params holds them.
    A greedy row (temperature 0) keeps only its argmax: log prob 0."""
    out = np.zeros(len(tokens), dtype=np.float32)
    sampled = np.flatnonzero(params[:, 0] > 0)
    if not sampled.size:
        return out
    temperature, top_k, top_p, min_p = (params[sampled, i] for i in range(4))
    scaled = logits[sampled].astype(np.float64) / temperature[:, None]
    top_k = top_k.astype(np.int64)
    if (top_k > 0).any() or (top_p < 1.0).any():
        scaled = _top_k_top_p(scaled, top_k, top_p)
    if (min_p > 0).any():  # relative to the most likely token, as the sampler's floor
        relative = np.exp(scaled - scaled.max(axis=1, keepdims=True))
        scaled = np.where(relative >= min_p[:, None], scaled, -np.inf)
    peak = scaled.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(scaled - peak).sum(axis=1)) + peak[:, 0]
    out[sampled] = scaled[np.arange(len(sampled)), tokens[sampled]] - log_z
    return out
