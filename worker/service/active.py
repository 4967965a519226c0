"""The requests a worker is running, shared by its three threads.

The I/O thread adds entries, the result pump removes finished ones, and the
Redis thread reads the ids to poll cancel flags for; one lock guards them all.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Active:
    exec_id: int
    gateway: bytes  # ZeroMQ routing id of the gateway that sent it
    request_id: str  # the gateway's id for it (the wire id): what results and cancels carry
    name: str  # the client's id: its Redis cancel flag and stats key, and the logs
    prompt_tokens: int
    received: float = field(default_factory=time.monotonic)
    output_tokens: int = 0
    cancelled: bool = False


class ActiveTable:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._by_exec: dict[int, Active] = {}
        self._by_key: dict[tuple[bytes, str], Active] = {}

    def add(self, entry: Active) -> None:
        """Caller holds `lock` (held across the enqueue, so the pump never sees an
        executor id before its entry)."""
        self._by_exec[entry.exec_id] = entry
        self._by_key[(entry.gateway, entry.request_id)] = entry

    def has(self, gateway: bytes, request_id: str) -> bool:
        with self.lock:
            return (gateway, request_id) in self._by_key

    def find(self, gateway: bytes, request_id: str) -> Active | None:
        with self.lock:
            return self._by_key.get((gateway, request_id))

    def get(self, exec_id: int) -> Active | None:
        """Caller holds `lock`."""
        return self._by_exec.get(exec_id)

    def remove(self, entry: Active) -> None:
        """Caller holds `lock`."""
        self._by_exec.pop(entry.exec_id, None)
        self._by_key.pop((entry.gateway, entry.request_id), None)

    def of_gateway(self, gateway: bytes) -> list[Active]:
        with self.lock:
            return [a for a in self._by_exec.values() if a.gateway == gateway]

    def snapshot(self) -> list[Active]:
        with self.lock:
            return list(self._by_exec.values())

    def __len__(self) -> int:
        return len(self._by_exec)
