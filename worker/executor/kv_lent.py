"""Buffers of KV blocks lent to another process (by CUDA IPC: worker/backends/torch_kv_ipc.py),
held until the borrower answers or a timeout passes.

A borrower that copied the blocks says so and the buffer is dropped; one that could
not open it says so and the buffer is handed back, to be sent another way; one that
never answers (it died, or its answer was lost) must not keep the memory: after
`lent_for_s` the buffer is dropped and `give_up` releases whatever hold the borrower
may still have on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# A lent buffer is freed this long after it was lent, answered or not. Borrowers open no
# handle older than a third of it (worker/backends/torch_kv_ipc.py's OPEN_WITHIN_S), so a
# copy out of a buffer never outlives it.
LENT_FOR_S = 30.0


@dataclass(frozen=True, slots=True)
class IpcBuffer:
    """What a borrower needs to open a buffer lent by CUDA IPC (protocol.CudaIpcBuffer's
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


class LentBuffers:
    def __init__(self, lent_for_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lent_for_s = lent_for_s
        self.clock = clock
        self._loans: dict[int, _Loan] = {}

    def __len__(self) -> int:
        return len(self._loans)

    def lend(self, key: int, buffer: Any, give_up: Callable[[], None]) -> None:
        self._loans[key] = _Loan(buffer, give_up, self.clock() + self.lent_for_s)

    def copied(self, key: int) -> bool:
        """The borrower copied the buffer: drop it. False where it is not held (expired)."""
        return self._loans.pop(key, None) is not None

    def refused(self, key: int) -> Any | None:
        """The borrower could not open the buffer: it comes back, for another way (None:
        it is not held)."""
        loan = self._loans.pop(key, None)
        if loan is None:
            return None
        loan.give_up()
        return loan.buffer

    def expire(self) -> list[int]:
        """Drop the buffers lent for longer than `lent_for_s`; their keys."""
        if not self._loans:
            return []
        now = self.clock()
        late = [key for key, loan in self._loans.items() if now >= loan.due]
        for key in late:
            self._loans.pop(key).give_up()
        return late
