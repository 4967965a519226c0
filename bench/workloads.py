"""The requests the offline benches send: random prompts of a fixed length."""

from __future__ import annotations

import numpy as np


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab - 10, (n, length)).tolist()
