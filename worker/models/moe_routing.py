"""How a token's router logits choose its experts and weigh their outputs, in float32
(ModelConfig.router):

- "softmax_topk" (Mixtral, Qwen3-MoE): probabilities over all experts, keep the top k;
  renormalised to sum to 1 when `norm_topk_prob` (Mixtral always, Qwen3-MoE by config);
- "topk_softmax" (gpt-oss): the top k logits (the router has a bias), then a softmax
  over just those.

This is the numpy definition; the torch backend's (worker/backends/torch_moe.py) follows
it step by step.
"""

from __future__ import annotations

import numpy as np

from worker.models.config import ModelConfig

ROUTERS = ("softmax_topk", "topk_softmax")


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _top_k(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest of each row, largest first: (values, indices) [N, k]."""
    index = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(x, index, axis=-1), index


def route(logits: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """(experts [N, k] int64, weights [N, k] float32) from router logits [N, experts]."""
    logits = logits.astype(np.float32, copy=False)
    k = config.experts_per_token
    if config.router == "topk_softmax":
        top, index = _top_k(logits, k)
        return index, _softmax(top)
    weights, index = _top_k(_softmax(logits), k)
    if config.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return index, weights
