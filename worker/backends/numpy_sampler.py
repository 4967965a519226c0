"""Batched token sampling in numpy: one vectorised pass over all rows of logits.

Per row, first the logits are processed: embedding bias added, repetition /
presence / frequency penalties applied to the tokens the row has seen, banned
tokens and tokens the row's grammar forbids set to -inf (log probs, top-N
included, are the log-softmax of these processed logits). Then: greedy rows (temperature 0) take the argmax;
sampled rows divide by the temperature, then keep the top-k logits, then the
smallest set of most likely tokens reaching top-p, then the tokens at least min-p
times as likely as the most likely one (each filter renormalises what the previous
kept), and pick by inverse CDF over token ids with the row's own uniform draw, so a
row's choice depends only on its logits, its parameters and its draw.
"""

from __future__ import annotations

import numpy as np

from worker.backends.base import SampleOutput, SamplingBatch


def _log_softmax_at(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    # exp in float32 (each term is within 1e-7 of float64), summed in float64: a fifth
    # of the time of a float64 copy of every row, which this runs on every step.
    peak = logits.max(axis=1, keepdims=True)
    terms = logits - peak
    np.exp(terms, out=terms)
    log_z = np.log(terms.sum(axis=1, dtype=np.float64)) + peak[:, 0]
    return (logits[np.arange(len(tokens)), tokens] - log_z).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _top_k_top_p(scaled: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    rows, vocab = scaled.shape
    k = np.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    use_p = top_p < 1.0
    # Values sorted high to low: all of them for top-p, only the k_max largest for top-k alone.
    width = vocab if use_p.any() else int(k.max())
    top = scaled if width == vocab else np.partition(-scaled, width - 1, axis=1)[:, :width] * -1
    desc = -np.sort(-top, axis=1)
    ar = np.arange(rows)
    # top-k: everything below the k-th largest value goes (ties with it stay)
    threshold = np.where(k < vocab, desc[ar, np.minimum(k, width) - 1], -np.inf)
    if use_p.any():
        desc = np.where(np.arange(width) < k[:, None], desc, -np.inf)
        probs = _softmax(desc)
        before = np.cumsum(probs, axis=1) - probs  # mass of the strictly more likely tokens
        keep = np.maximum((before < top_p[:, None].astype(np.float64)).sum(axis=1), 1)
        threshold = np.where(use_p, np.maximum(threshold, desc[ar, keep - 1]), threshold)
    return np.where(scaled >= threshold[:, None], scaled, -np.inf)


def _sample_rows(
    logits: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    uniform: np.ndarray,
) -> np.ndarray:
    scaled = logits.astype(np.float64) / temperature.astype(np.float64)[:, None]
    if (top_k > 0).any() or (top_p < 1.0).any():
        scaled = _top_k_top_p(scaled, top_k, top_p)
    probs = _softmax(scaled)
    if (min_p > 0).any():
        floor = min_p.astype(np.float64)[:, None] * probs.max(axis=1, keepdims=True)
        probs = np.where(probs >= floor, probs, 0.0)
    cdf = np.cumsum(probs, axis=1)
    target = uniform[:, None] * cdf[:, -1:]
    # first token whose cumulative mass exceeds the target; tokens of zero mass never are
    chosen = (cdf <= target).sum(axis=1)
    return np.minimum(chosen, logits.shape[1] - 1)


def unpack_mask(words: np.ndarray, vocab: int) -> np.ndarray:
    """int32 [G, W] bitmask (bit j of word w: token 32 w + j) -> bool [G, vocab]."""
    bits = np.unpackbits(np.ascontiguousarray(words, dtype="<i4").view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab].astype(bool)


def _changes_logits(sampling: SamplingBatch) -> bool:
    return any(
        rows is not None and rows.size
        for rows in (sampling.bias_rows, sampling.seen_rows, sampling.ban_rows, sampling.mask_rows)
    )


def process_logits(logits: np.ndarray, sampling: SamplingBatch) -> np.ndarray:
    """The logits sampling and log probs see: bias, penalties, bans, grammar mask
    (in place on a float32 copy; the input itself when there is nothing to apply)."""
    if not _changes_logits(sampling):
        return np.asarray(logits, dtype=np.float32)
    logits = np.array(logits, dtype=np.float32, copy=True)
    if sampling.bias_rows is not None and sampling.bias_rows.size:
        assert sampling.bias is not None
        logits[sampling.bias_rows] += sampling.bias
    if sampling.seen_rows is not None and sampling.seen_rows.size:
        rows, tokens = sampling.seen_rows, sampling.seen_tokens
        assert tokens is not None and sampling.seen_counts is not None
        values = logits[rows, tokens]
        if sampling.repetition_penalty is not None:
            penalty = sampling.repetition_penalty[rows]
            values = np.where(values > 0, values / penalty, values * penalty)
        counts = sampling.seen_counts.astype(np.float32)
        if sampling.presence_penalty is not None:
            values = values - sampling.presence_penalty[rows] * (counts > 0)
        if sampling.frequency_penalty is not None:
            values = values - sampling.frequency_penalty[rows] * counts
        logits[rows, tokens] = values
    if sampling.ban_rows.size:
        logits[sampling.ban_rows, sampling.ban_tokens] = -np.inf
    if sampling.mask_rows is not None and sampling.mask_rows.size:
        assert sampling.token_mask is not None
        allowed = unpack_mask(sampling.token_mask, logits.shape[1])
        sub = logits[sampling.mask_rows]
        sub[~allowed] = -np.inf
        logits[sampling.mask_rows] = sub
    return logits


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    rows = logits.astype(np.float64)
    peak = rows.max(axis=1, keepdims=True)
    return rows - (np.log(np.exp(rows - peak).sum(axis=1, keepdims=True)) + peak)


def top_n(logits: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n most likely tokens per row, most likely first (ties: lower id first),
    and their log-softmax values."""
    n = min(n, logits.shape[1])
    part = (
        np.argpartition(-logits, n - 1, axis=1)[:, :n]
        if n < logits.shape[1]
        else np.tile(np.arange(logits.shape[1]), (logits.shape[0], 1))
    )
    values = np.take_along_axis(logits, part, axis=1)
    order = np.lexsort((part, -values), axis=1)
    tokens = np.take_along_axis(part, order, axis=1).astype(np.int64)
    lp = np.take_along_axis(_log_softmax(logits), tokens, axis=1).astype(np.float32)
    return tokens, lp


def sample(logits: np.ndarray, sampling: SamplingBatch) -> SampleOutput:
    logits = process_logits(logits, sampling)
    tokens = logits.argmax(axis=1).astype(np.int64)
    sampled = np.flatnonzero(sampling.temperature > 0)
    if sampled.size:
        tokens[sampled] = _sample_rows(
            logits[sampled],
            sampling.temperature[sampled],
            sampling.top_k[sampled],
            sampling.top_p[sampled],
            sampling.min_p[sampled],
            sampling.uniform[sampled],
        )
    top_tokens, top_lp = top_n(logits, sampling.top_n) if sampling.top_n else (None, None)
    return SampleOutput(tokens, _log_softmax_at(logits, tokens), top_tokens, top_lp)
