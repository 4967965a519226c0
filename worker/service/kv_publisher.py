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
from worker.executor.block_manager import BlockEvent, Tier


class KvPublisher:
    def __init__(self, sender_id: str, block_size: int) -> None:
        self.sender_id = sender_id
        self.block_size = block_size
        self.incarnation = uuid.uuid4().hex
        self.seq = 0  # of the last KvEvents made
        self.held: dict[int, Tier] = {}  # hash -> the tier holding it

    def fold(self, batches: Iterable[list[BlockEvent]]) -> protocol.KvEvents | None:
        """One message for the engine's event lists, in order; None when they change nothing."""
        net: dict[int, Tier | None] = {}  # hash -> its tier (None: removed), as of the last event
        for events in batches:
            for tier, h in events:
                net[h] = tier
        changed = {h: tier for h, tier in net.items() if self.held.get(h) != tier}
        if not changed:
            return None
        for h, tier in changed.items():
            if tier is None:
                del self.held[h]
            else:
                self.held[h] = tier
        self.seq += 1
        return protocol.KvEvents(sender_id=self.sender_id, incarnation=self.incarnation, seq=self.seq,
                                 stored=[h for h, t in changed.items() if t == "device"],
                                 stored_host=[h for h, t in changed.items() if t == "host"],
                                 removed=[h for h, t in changed.items() if t is None])  # fmt: skip

    def snapshot(self) -> protocol.KvSnapshot:
        return protocol.KvSnapshot(sender_id=self.sender_id, incarnation=self.incarnation, seq=self.seq,
                                   block_size=self.block_size,
                                   hashes=[h for h, t in self.held.items() if t == "device"],
                                   host_hashes=[h for h, t in self.held.items() if t == "host"])  # fmt: skip
