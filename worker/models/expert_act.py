"""The experts' activation of gate and up (ModelConfig.expert_act), in numpy; the torch
backend's (worker/backends/torch_moe.py) follows it with the same constants.

- "silu": silu(gate) * up (Mixtral, Qwen3-MoE);
- "swiglu_clamped" (gpt-oss): gate clamped above and up on both sides at SWIGLU_LIMIT,
  then (up + 1) * gate * sigmoid(SWIGLU_ALPHA * gate).
"""

from __future__ import annotations

import numpy as np

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def expert_act(gate_up: np.ndarray, kind: str) -> np.ndarray:
    """[N, 2I] (gate, then up) float32 -> [N, I]."""
    n = gate_up.shape[1] // 2
    gate, up = gate_up[:, :n], gate_up[:, n:]
    if kind == "swiglu_clamped":
        gate = np.minimum(gate, np.float32(SWIGLU_LIMIT))
        up = np.clip(up, np.float32(-SWIGLU_LIMIT), np.float32(SWIGLU_LIMIT))
        return (up + np.float32(1.0)) * gate / (np.float32(1.0) + np.exp(np.float32(-SWIGLU_ALPHA) * gate))
    return gate / (np.float32(1.0) + np.exp(-gate)) * up
