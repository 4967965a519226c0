"""The worker's KV cache index as gateways see it: the engine's block events folded
into numbered KvEvents messages, and a snapshot on request.

The engine's log starts with its empty cache and crosses the pipe in order, so
the set kept here is the block manager's index as of the last event folded in.
One incarnation name per worker process: a gateway that sees another knows the
worker restarted with an empty cache and everything it held is gone.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

import protocol
from worker.executor.block_manager import BlockEvent


class KvPublisher:
    def __init__(self, sender_id: str, block_size: int) -> None:
        self.sender_id = sender_id
        self.block_size = block_size
        self.incarnation = uuid.uuid4().hex
        self.seq = 0  # of the last KvEvents made
        self.held: set[int] = set()

    def fold(self, batches: Iterable[list[BlockEvent]]) -> protocol.KvEvents | None:
        """One message for the engine's event lists, in order; None when they change nothing."""
        net: dict[int, bool] = {}  # hash -> stored (True) or removed (False), as of the last event
        for events in batches:
            for is_stored, h in events:
                net[h] = is_stored
        stored = [h for h, s in net.items() if s and h not in self.held]
        removed = [h for h, s in net.items() if not s and h in self.held]
        if not stored and not removed:
            return None
        self.held.update(stored)
        self.held.difference_update(removed)
        self.seq += 1
        return protocol.KvEvents(sender_id=self.sender_id, incarnation=self.incarnation, seq=self.seq,
                                 stored=stored, removed=removed)  # fmt: skip

    def snapshot(self) -> protocol.KvSnapshot:
        return protocol.KvSnapshot(sender_id=self.sender_id, incarnation=self.incarnation, seq=self.seq,
                                   block_size=self.block_size, hashes=list(self.held))  # fmt: skip
