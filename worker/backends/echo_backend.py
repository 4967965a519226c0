"""TRANSPORT TEST ONLY: a Backend that computes nothing.

`forward` hands back each sequence's last input token and `sample` picks it, so
every request streams its last prompt token over and over at no compute cost.
It exists to measure how many tokens per second the worker service and a
gateway can move, with the model taken out of the picture. Never serve users
with it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from worker.backends.base import ForwardBatch, SampleOutput, SamplingBatch
from worker.models.config import ModelConfig

# What the executor sizes its block pool from; no memory is allocated for it.
_PRETEND_FREE_BYTES = 1 << 30


class EchoBackend:
    name = "echo (transport test)"

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def kv_bytes_per_token(self) -> int:
        return 2 * self.config.num_layers * self.config.num_kv_heads * self.config.head_dim * 4

    def free_memory_bytes(self) -> int:
        return _PRETEND_FREE_BYTES

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        pass

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        pass

    def forward(self, batch: ForwardBatch) -> Any:
        return batch.token_ids[batch.logits_indices]

    def sample(self, logits: Any, sampling: SamplingBatch) -> SampleOutput:
        ids = np.asarray(logits, dtype=np.int64)
        zeros = np.zeros(ids.shape[0], dtype=np.float32)
        if not sampling.top_n:
            return SampleOutput(token_ids=ids, log_probs=zeros)
        # Top log probs (and beam candidates): the echoed token, certain, then the ones after it.
        top = (ids[:, None] + np.arange(sampling.top_n)) % self.config.vocab_size
        top_log_probs = np.full(top.shape, -1e9, dtype=np.float32)
        top_log_probs[:, 0] = 0.0
        return SampleOutput(token_ids=ids, log_probs=zeros, top_tokens=top, top_log_probs=top_log_probs)

    def logits_to_host(self, logits: Any) -> np.ndarray:
        # One-hot rows, so post-processors and logits outputs see something well-formed.
        ids = np.asarray(logits, dtype=np.int64)
        out = np.full((ids.shape[0], self.config.vocab_size), -1e9, dtype=np.float32)
        out[np.arange(ids.shape[0]), ids] = 0.0
        return out
