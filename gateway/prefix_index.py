"""One worker's KV cache index as a gateway mirrors it: the block hashes in its device
memory and those in its host tier, kept current by the worker's numbered KvEvents,
replaced whole by a KvSnapshot.

Block hashes are chained (protocol/block_hash.py), so sets are enough: the blocks a
worker holds of a prompt are the longest prefix of the prompt's chain in its sets.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import protocol

# A snapshot asked for and not come (lost with a reconnect) is asked again after this.
ASK_AGAIN_S = 2.0


class PrefixIndex:
    def __init__(self) -> None:
        self.hashes: set[int] = set()  # in device memory
        self.host_hashes: set[int] = set()  # in the host tier
        self.incarnation: str | None = None
        self.seq = 0  # the last event applied, or the snapshot's
        self.block_size: int | None = None
        self.synced = False  # a snapshot and every event since it are applied
        self._asked_at: float | None = None

    def apply_events(self, msg: protocol.KvEvents) -> bool:
        """Apply what the worker's cache gained and lost; True when a snapshot must be
        asked for: a gap in the numbers, or a new incarnation that did not start here."""
        if msg.incarnation != self.incarnation:
            # The worker restarted: its cache started empty, so what was held here is gone.
            self.hashes.clear()
            self.host_hashes.clear()
            self.incarnation, self.seq, self.synced = msg.incarnation, 0, True
        if msg.seq <= self.seq and self.synced:
            return False  # the snapshot already held it
        if not self.synced or msg.seq != self.seq + 1:
            self.synced = False  # what is held stays a hint until the snapshot replaces it
            return self._ask()
        for gone in (msg.removed, msg.stored_host):
            self.hashes.difference_update(gone)
        for gone in (msg.removed, msg.stored):
            self.host_hashes.difference_update(gone)
        self.hashes.update(msg.stored)
        self.host_hashes.update(msg.stored_host)
        self.seq = msg.seq
        return False

    def apply_snapshot(self, msg: protocol.KvSnapshot) -> None:
        if self.synced and msg.incarnation == self.incarnation and msg.seq <= self.seq:
            return  # an answer to an earlier ask: the events since it are applied already
        self.hashes, self.host_hashes = set(msg.hashes), set(msg.host_hashes)
        self.incarnation, self.seq, self.block_size = msg.incarnation, msg.seq, msg.block_size
        self.synced, self._asked_at = True, None

    def matched(self, chain: Sequence[int]) -> tuple[int, int]:
        """How many leading blocks of a prompt's hash chain the worker holds in either
        tier, and how many of those are in its host tier."""
        n = host = 0
        for h in chain:
            if h in self.hashes:
                pass
            elif h in self.host_hashes:
                host += 1
            else:
                break
            n += 1
        return n, host

    def _ask(self) -> bool:
        now = time.monotonic()
        if self._asked_at is not None and now - self._asked_at < ASK_AGAIN_S:
            return False
        self._asked_at = now
        return True
