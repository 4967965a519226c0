"""Buffers of KV blocks shared to another process (by CUDA IPC: worker/backends/torch_kv_ipc.py),
held until the receiver answers or a timeout passes.

A receiver that copied the blocks says so and the buffer is dropped; one that could
not open it says so and the buffer is handed back, to be sent another way; one that
never answers (it died, or its answer was lost) must not keep the memory: after
`shared_for_s` the buffer is dropped and `give_up` releases whatever hold the receiver
may still have on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# A shared buffer is freed this long after it was shared, answered or not. Receivers open no
# handle older than a third of it (worker/backends/torch_kv_ipc.py's OPEN_WITHIN_S), so a
# copy out of a buffer never outlives it.
SHARED_FOR_S = 30.0


@dataclass(frozen=True, slots=True)
class IpcBuffer:
    """What a receiver needs to open a buffer shared by CUDA IPC (protocol.CudaIpcBuffer's
    fields; worker/backends/torch_kv_ipc.py makes and opens them)."""

    host_id: str
    device_uuid: str
    handle: bytes
    offset: int
    size: int
    ref_counter: str
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(slots=True)
class _Loan:
    buffer: Any
    give_up: Callable[[], None]
    due: float


class SharedBuffers:
    def __init__(self, shared_for_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.shared_for_s = shared_for_s
        self.clock = clock
        self._loans: dict[int, _Loan] = {}

    def __len__(self) -> int:
        return len(self._loans)

    def keep(self, key: int, buffer: Any, give_up: Callable[[], None]) -> None:
        self._loans[key] = _Loan(buffer, give_up, self.clock() + self.shared_for_s)

    def copied(self, key: int) -> bool:
        """The receiver copied the buffer: drop it. False where it is not held (expired)."""
        return self._loans.pop(key, None) is not None

    def refused(self, key: int) -> Any | None:
        """The receiver could not open the buffer: it comes back, for another way (None:
        it is not held)."""
        loan = self._loans.pop(key, None)
        if loan is None:
            return None
        loan.give_up()
        return loan.buffer

    def expire(self) -> list[int]:
        """Drop the buffers shared for longer than `shared_for_s`; their keys."""
        if not self._loans:
            return []
        now = self.clock()
        late = [key for key, loan in self._loans.items() if now >= loan.due]
        for key in late:
            self._loans.pop(key).give_up()
        return late
