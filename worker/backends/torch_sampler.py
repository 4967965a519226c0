"""Batched sampling on the device: one vectorised pass over all rows of logits.

The same rules as the numpy reference (numpy_sampler.py), so both backends pick
the same token from the same logits and draw. First the logits are processed:
embedding bias added, repetition / presence / frequency penalties applied to the
tokens each row has seen, banned tokens and tokens the row's grammar forbids set
to -inf (log probs, top-N included, are the log-softmax of these). Then greedy rows
(temperature 0) take the argmax; sampled rows divide by the temperature, keep the
logits >= the k-th largest (top-k), then the smallest set of most likely tokens
whose renormalised mass reaches top-p, then the tokens at least min-p times as
likely as the most likely, and invert the CDF, over token ids, at the row's own
uniform draw (seeded per request on the host, so a row never depends on its batch).
Sampled rows are computed in float64, as the reference does.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.backends import logits_argmax
from worker.backends.base import SamplingBatch
from worker.backends.memory_plan import SAMPLE_CHUNK_ROWS


def _to(device: torch.device, a: object, dtype: torch.dtype) -> torch.Tensor:
    t = torch.as_tensor(a, dtype=dtype)
    if device.type == "cuda":
        # From pageable memory the driver may wait for the stream to drain before the
        # copy; pinned (torch's caching host allocator), it is queued like a kernel.
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _has(rows: np.ndarray | None) -> bool:
    return rows is not None and rows.size > 0


def process_logits(logits: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
    """Bias, penalties, bans and grammar mask; a float32 copy when any applies."""
    s = sampling
    if not (_has(s.bias_rows) or _has(s.seen_rows) or s.ban_rows.size or _has(s.mask_rows)):
        return logits
    device = logits.device
    logits = logits.float().clone()
    if _has(s.bias_rows):
        logits[_to(device, s.bias_rows, torch.int64)] += _to(device, s.bias, torch.float32)
    if _has(s.seen_rows):
        rows, tokens = _to(device, s.seen_rows, torch.int64), _to(device, s.seen_tokens, torch.int64)
        values = logits[rows, tokens]
        if s.repetition_penalty is not None:
            penalty = _to(device, s.repetition_penalty, torch.float32)[rows]
            values = torch.where(values > 0, values / penalty, values * penalty)
        counts = _to(device, s.seen_counts, torch.float32)
        if s.presence_penalty is not None:
            values = values - _to(device, s.presence_penalty, torch.float32)[rows] * (counts > 0)
        if s.frequency_penalty is not None:
            values = values - _to(device, s.frequency_penalty, torch.float32)[rows] * counts
        logits[rows, tokens] = values
    if s.ban_rows.size:
        # A Python scalar assigned through advanced indexing is first copied to the device
        # by value, and that copy waits for the stream: the host would stall until the
        # step's forward ends. index_fill_ takes the scalar as it is.
        flat = s.ban_rows * logits.shape[1] + s.ban_tokens
        logits.view(-1).index_fill_(0, _to(device, flat, torch.int64), float("-inf"))
    if _has(s.mask_rows):
        # Bit j of int32 word w allows token 32 w + j (arithmetic shift, then & 1, reads any bit).
        words = _to(device, s.token_mask, torch.int32)
        bits = (words[:, :, None] >> torch.arange(32, device=device, dtype=torch.int32)) & 1
        allowed = bits.reshape(words.shape[0], -1)[:, : logits.shape[1]].bool()
        rows = _to(device, s.mask_rows, torch.int64)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def top_n(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n most likely tokens per row, most likely first (ties: lower id first),
    and their log-softmax values."""
    n = min(n, logits.shape[1])
    # A stable descending sort keeps equal logits in id order.
    tokens = logits.sort(dim=-1, descending=True, stable=True).indices[:, :n]
    return tokens, torch.log_softmax(logits.float(), dim=-1).gather(1, tokens)


def sample_tokens(logits: torch.Tensor, sampling: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """logits float32 [S, V] on the device -> (token ids int64 [S], log probs float32 [S])."""
    ids, log_probs, _ = sample_all(logits, sampling)
    return ids, log_probs


def sample_all(
    logits: torch.Tensor, sampling: SamplingBatch
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """As sample_tokens, plus the top-N tokens and log probs when sampling.top_n asks."""
    device = logits.device
    logits = process_logits(logits, sampling)
    if logits.is_cuda and logits_argmax.triton is not None and logits.dtype == torch.float32 and logits.stride(1) == 1:
        chosen, lse = logits_argmax.argmax_logsumexp(logits)
    else:
        chosen, lse = logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1)
    if not sampling.all_greedy:
        sampled = np.flatnonzero(sampling.temperature > 0)
        # A few rows at a time: the float64 workspace per row is ~48 bytes per logit
        # (memory_plan.py), 6 MB at a 128k vocabulary, too much to hold for a whole batch.
        for start in range(0, sampled.size, SAMPLE_CHUNK_ROWS):
            rows = sampled[start : start + SAMPLE_CHUNK_ROWS]
            on_device = _to(device, rows, torch.int64)
            chosen[on_device] = _sample_rows(logits[on_device], sampling, rows)
    log_probs = logits.gather(1, chosen[:, None])[:, 0] - lse
    return chosen, log_probs, (top_n(logits, sampling.top_n) if sampling.top_n else None)


def warm_up_batch(vocab: int) -> SamplingBatch:
    """Two rows that take every rule of the sampler once: a greedy row with a ban, a grammar
    mask and penalties, and a sampled row with bias, top-k, top-p and min-p, top-N for both.
    Sampled at start-up (TorchBackend.warm_up): on the H100 the first greedy step with a ban
    held the host 45 ms and the first sampled row 238 ms, 0.4 and 2.7 ms after (CUDA loads
    each torch kernel's module on its first launch), while every running request waited."""
    return SamplingBatch(
        temperature=np.array([0.0, 1.0], np.float32),
        top_k=np.array([0, 2], np.int64),
        top_p=np.array([1.0, 0.9], np.float32),
        min_p=np.array([0.0, 0.1], np.float32),
        uniform=np.array([0.0, 0.5]),
        ban_rows=np.array([0], np.int64),
        ban_tokens=np.array([0], np.int64),
        bias_rows=np.array([1], np.int64),
        bias=np.zeros((1, vocab), np.float32),
        repetition_penalty=np.array([1.1, 1.0], np.float32),
        presence_penalty=np.array([0.5, 0.0], np.float32),
        frequency_penalty=np.array([0.5, 0.0], np.float32),
        seen_rows=np.array([0], np.int64),
        seen_tokens=np.array([1], np.int64),
        seen_counts=np.array([1], np.int64),
        mask_rows=np.array([0], np.int64),
        token_mask=np.full((1, -(-vocab // 32)), -1, np.int32),
        top_n=2,
    )


def _sample_rows(logits: torch.Tensor, sampling: SamplingBatch, rows: np.ndarray) -> torch.Tensor:
    device = logits.device
    temperature = _to(device, sampling.temperature[rows], torch.float64)
    top_k = _to(device, sampling.top_k[rows], torch.int64)
    top_p = _to(device, sampling.top_p[rows], torch.float64)
    min_p = _to(device, sampling.min_p[rows], torch.float64)
    uniform = _to(device, sampling.uniform[rows], torch.float64)
    vocab = logits.shape[1]
    scaled = logits.double() / temperature[:, None]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    desc = scaled.sort(dim=-1, descending=True).values
    # top-k: everything below the k-th largest value goes (ties with it stay).
    threshold = torch.where(
        k < vocab, desc.gather(1, (k - 1)[:, None])[:, 0], torch.full_like(temperature, float("-inf"))
    )
    use_p = top_p < 1.0
    if (sampling.top_p[rows] < 1.0).any():  # asked of the host copy: the device's would wait for the stream
        rank = torch.arange(vocab, device=device)[None, :]
        desc = desc.masked_fill(rank >= k[:, None], float("-inf"))
        probs = torch.softmax(desc, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        keep = (before < top_p[:, None]).sum(dim=-1).clamp(min=1)
        cut = desc.gather(1, (keep - 1)[:, None])[:, 0]
        threshold = torch.where(use_p, torch.maximum(threshold, cut), threshold)
    scaled = scaled.masked_fill(scaled < threshold[:, None], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    probs = probs.masked_fill(probs < floor, 0.0)
    cdf = probs.cumsum(dim=-1)
    target = uniform[:, None] * cdf[:, -1:]
    # The first token whose cumulative mass exceeds the target; zero-mass tokens never are.
    picked = (cdf <= target).sum(dim=-1)
    return picked.clamp(max=vocab - 1)
