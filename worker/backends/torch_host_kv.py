"""The host tier of the torch KV pool (HostKvBackend): one slot per block, holding
the block's K and V of every layer together, so a block crosses in one contiguous copy.

The slots are the pool's bytes (an FP8 pool's too: copied as bytes, the way
copy_blocks copies them). On CUDA they are pinned, and the copies run on a side
stream: the step after them waits on their event, the host never does. The side
stream must not overtake the steps still running on the compute stream either,
but waiting for all of them would take the copies off the compute's shoulders
only to put them after it. So it waits for what was queued before the last step
launched, and for that step too only when the copies touch a block it lists (a
block just freed may still be written by the step in flight, for a sequence that
ended before its token came back); the steps before the last have completed by
the time the executor schedules, so that wait costs nothing there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


class TorchHostKv:
    def __init__(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], num_blocks: int) -> None:
        self.k = [k.view(torch.uint8) for k in k_cache]  # [blocks, block_size, kv_heads, head_dim * itemsize]
        self.v = [v.view(torch.uint8) for v in v_cache]
        self.device = k_cache[0].device
        cuda = self.device.type == "cuda"
        # [slots, layers, 2 (K, V), block_size, kv_heads, head_dim * itemsize]
        self.slots = torch.empty((num_blocks, len(self.k), 2, *self.k[0].shape[1:]), dtype=torch.uint8,
                                 pin_memory=cuda)  # fmt: skip
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self._before_last: torch.cuda.Event | None = None  # the compute stream before the last step
        self._last_tables: np.ndarray | None = None  # the block tables of the last step

    def launching(self, block_tables: np.ndarray) -> None:
        """A step is about to be queued on the compute stream with these block tables."""
        if self.stream is not None:
            self._before_last = torch.cuda.current_stream(self.device).record_event()
            self._last_tables = block_tables

    def offload(self, device_blocks: np.ndarray, host_slots: np.ndarray) -> None:
        with self._side(device_blocks):
            src = torch.from_numpy(device_blocks).to(self.device)
            # [N, layers, 2, ...]: each block's bytes contiguous, one copy per slot
            staged = torch.stack([torch.stack((k[src], v[src]), dim=1) for k, v in zip(self.k, self.v, strict=True)],
                                 dim=1)  # fmt: skip
            if self.stream is None:
                self.slots[torch.from_numpy(host_slots)] = staged
                return
            for i, slot in enumerate(host_slots.tolist()):
                self.slots[slot].copy_(staged[i], non_blocking=True)

    def load(self, host_slots: np.ndarray, device_blocks: np.ndarray) -> None:
        with self._side(device_blocks):
            dst = torch.from_numpy(device_blocks).to(self.device)
            if self.stream is None:
                staged = self.slots[torch.from_numpy(host_slots)]
            else:
                staged = torch.empty((len(host_slots), *self.slots.shape[1:]), dtype=torch.uint8, device=self.device)
                for i, slot in enumerate(host_slots.tolist()):
                    staged[i].copy_(self.slots[slot], non_blocking=True)
            for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
                k.index_copy_(0, dst, staged[:, layer, 0])
                v.index_copy_(0, dst, staged[:, layer, 1])

    @contextmanager
    def _side(self, device_blocks: np.ndarray) -> Iterator[None]:
        """Run the copies queued inside on the side stream, after what they must follow;
        the compute stream waits for them before its next step."""
        side = self.stream
        if side is None:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        if self._last_tables is not None and np.isin(device_blocks, self._last_tables).any():
            side.wait_stream(compute)
        elif self._before_last is not None:
            side.wait_event(self._before_last)
        with torch.cuda.stream(side):
            yield
        compute.wait_event(side.record_event())
