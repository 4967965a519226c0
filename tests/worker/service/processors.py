"""Logits post-processors a test worker loads by import path."""

from __future__ import annotations

import numpy as np

FORCED_TOKEN = 7


def force_token(request_id: int, logits: np.ndarray, tokens: list[list[int]], client_id: int | None) -> None:
    """Leave FORCED_TOKEN the only possible choice."""
    logits[:] = -np.inf
    logits[..., FORCED_TOKEN] = 0.0
