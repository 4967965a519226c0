"""Batched sampling on the device: one vectorised pass over all rows of logits.

The same rules as the numpy reference (numpy_sampler.py), so both backends pick
the same token from the same logits and draw: banned tokens go to -inf; greedy rows
(temperature 0) take the argmax; sampled rows divide by the temperature, keep the
logits >= the k-th largest (top-k), then the smallest set of most likely tokens
whose renormalised mass reaches top-p, then the tokens at least min-p times as
likely as the most likely, and invert the CDF, over token ids, at the row's own
uniform draw (seeded per request on the host, so a row never depends on its batch).
The log prob is the log-softmax of the banned logits at the chosen token.
Sampled rows are computed in float64, as the reference does.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.backends.base import SamplingBatch


def _to(device: torch.device, a: object, dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(a, dtype=dtype).to(device, non_blocking=True)


def sample_tokens(logits: torch.Tensor, sampling: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """logits float32 [S, V] on the device -> (token ids int64 [S], log probs float32 [S])."""
    device = logits.device
    if len(sampling.ban_rows):
        logits = logits.clone()
        rows = _to(device, sampling.ban_rows, torch.int64)
        logits[rows, _to(device, sampling.ban_tokens, torch.int64)] = float("-inf")
    chosen = logits.argmax(dim=-1)
    if not sampling.all_greedy:
        sampled = np.flatnonzero(sampling.temperature > 0)
        on_device = _to(device, sampled, torch.int64)
        chosen[on_device] = _sample_rows(logits[on_device], sampling, sampled)
    log_probs = logits.gather(1, chosen[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    return chosen, log_probs


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
    if bool(use_p.any()):
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
