"""One step's metadata on the torch device: StepInputs, the form the decoder's torch ops
consume, and the pinned staging buffers that carry it there in one copy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class StepInputs:
    """One step's metadata on the device (int32), as the forward consumes it."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    tile_seq: torch.Tensor
    tile_q0: torch.Tensor
    block_q: int
    splits: int  # programs per sequence's keys in generation-only steps
    logits_indices: torch.Tensor | None  # None: every row (generation-only steps)
    # Host copies for the CPU attention path.
    query_start_host: np.ndarray
    seq_lens_host: np.ndarray
    # LoRA: each token's adapter slot (-1: none), and each logits row's; None: no adapter.
    lora_slots: torch.Tensor | None = None  # int64 [T]
    lora_logits_slots: torch.Tensor | None = None  # int64 [S]
    # Prompt tuning: rows whose embedding is given (ForwardBatch.prompt_rows).
    prompt_rows: torch.Tensor | None = None  # int64 [P]
    prompt_embeds: torch.Tensor | None = None  # [P, hidden], the compute dtype


class PinnedStaging:
    """Two pinned int32 buffers used in turn, so the host can fill step N+1's metadata
    while step N's copy may still be in flight; on the CPU, plain tensors."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._bufs = [torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def host(self, n: int) -> torch.Tensor:
        if not self.pinned:
            return torch.empty(n, dtype=torch.int32)
        self._turn ^= 1
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        if self._bufs[self._turn].shape[0] < n:
            size = max(n, 2 * self._bufs[self._turn].shape[0])
            self._bufs[self._turn] = torch.empty(size, dtype=torch.int32, pin_memory=True)
        return self._bufs[self._turn][:n]

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        if not self.pinned:
            return host
        dev = host.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[self._turn] = event
        return dev
