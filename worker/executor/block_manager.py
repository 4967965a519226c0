"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, prefix reuse.

A block that fills up gets a hash chained over every token before it, so two
sequences with the same prefix map it to the same physical block. Freed blocks
keep their hash and contents until the allocator needs them: those are the
"cached" blocks, reused on a hash hit and evicted least-recently-freed first.

With a host tier (`host_blocks`, host_blocks.py), a cached block the allocator
takes is not dropped: its hash moves to a host slot and its KV is copied there;
a later prefix hit on it takes a free device block and copies the KV back before
the step that reads it. A hash lives in one tier at a time. The copies are only
decided here: `take_transfers` hands each step's to the engine, which has the
backend issue them (offloads first, then loads) before the step's forward.

With the event log on (`record_events`), every hash that enters, changes tier or
leaves the cache index is logged in order, for whoever drives the core to publish:
a gateway mirrors each worker's index from it to route prompts to their prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from protocol.block_hash import NO_HASH, chain_hash, first_hash
from worker.executor.host_blocks import HostBlocks
from worker.executor.kv_transfers import KvTransfers

Tier = Literal["device", "host"]
# An entry of the event log: (tier, hash) the hash is now held in that tier (it entered
# the index or moved), (None, hash) it left the index.
BlockEvent = tuple[Tier | None, int]


class Hit(NamedTuple):
    """One block of a cached prefix: a device block id, or a host slot when on_host."""

    on_host: bool
    where: int


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class BlockTable:
    """The physical blocks of one sequence, in order, and how many are hashed."""

    block_ids: list[int] = field(default_factory=list)
    num_hashed: int = 0
    num_from_host: int = 0  # of the prefix found cached at allocation, the blocks the host tier held


class OutOfBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_reuse: bool = True, host_blocks: int = 0) -> None:
        """`host_blocks`: slots of the host tier (0: none, evicted blocks are dropped)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_reuse = enable_reuse
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks; allocation takes from the front. Blocks without a
        # hash go to the front (nothing to lose), cached ones to the back (LRU).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[int, int] = {}
        self.reused_blocks = 0  # cumulative prefix-cache hits, both tiers
        self.host = HostBlocks(host_blocks) if host_blocks and enable_reuse else None
        self.reused_host_blocks = 0  # of those, the blocks loaded from the host tier
        self.offloaded_blocks = 0  # cumulative: blocks copied to the host tier
        self._offloads: list[tuple[int, int]] = []  # (device block, host slot), not handed over yet
        self._loads: dict[int, int] = {}  # device block -> host slot, not handed over yet
        self._events: list[BlockEvent] | None = None  # off: nobody drains it

    def record_events(self) -> None:
        """Log index changes from now on; the caller must drain them with `take_events`.
        The log starts from the index as it is, so turn it on before the first request."""
        self._events = []

    def take_events(self) -> list[BlockEvent]:
        """The index changes since the last call, in order; [] with the log off."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    # -- queries ---------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, token_ids: Seq[int], salt: int | None = None) -> list[Hit]:
        """The blocks, in either tier, that hold a prefix of token_ids, never the whole
        sequence: the last token is always recomputed, since its logits are needed."""
        if not self.enable_reuse:
            return []
        hits: list[Hit] = []
        prev = first_hash(salt)
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            chunk = tuple(token_ids[start : start + bs])
            h = chain_hash(prev, chunk)
            block_id = self._by_hash.get(h)
            if block_id is not None and self.blocks[block_id].token_ids == chunk:
                hits.append(Hit(False, block_id))
            elif self.host is not None and (slot := self.host.lookup(h, chunk)) is not None:
                hits.append(Hit(True, slot))
            else:
                break
            prev = h
        return hits

    def free_blocks_needed(self, hits: Seq[Hit], num_tokens: int) -> int:
        """Free device blocks an allocation of num_tokens with these cached blocks takes:
        the new ones, a cached device block revived, a block loaded from the host."""
        device = sum(1 for hit in hits if not hit.on_host)
        revived = sum(1 for hit in hits if not hit.on_host and self.blocks[hit.where].ref_count == 0)
        return self.blocks_for(num_tokens) - device + revived

    # -- allocation ------------------------------------------------------------

    def allocate_prompt(self, table: BlockTable, token_ids: Seq[int], num_tokens: int,
                        salt: int | None = None) -> int:
        """Give an empty table blocks for num_tokens tokens, reusing cached prefix
        blocks (those on the host are loaded into free device blocks). Returns how
        many leading tokens are already in the cache."""
        assert not table.block_ids, "allocate_prompt needs an empty block table"
        hits = self.cached_prefix(token_ids, salt)
        need = self.free_blocks_needed(hits, num_tokens)
        if need > self.num_free:
            raise OutOfBlocksError(f"need {need} blocks, {self.num_free} free")
        # Every hit is held before any block is taken, so taking one never evicts another.
        loaded = {hit.where: self.host.take(hit.where) for hit in hits if hit.on_host and self.host is not None}
        for hit in hits:
            if not hit.on_host:
                self._ref(hit.where)
        for hit in hits:
            table.block_ids.append(self._load(hit.where, *loaded[hit.where]) if hit.on_host else hit.where)
        self.reused_blocks += len(hits)
        self.reused_host_blocks += len(loaded)
        table.num_hashed = len(hits)
        table.num_from_host = len(loaded)
        for _ in range(self.blocks_for(num_tokens) - len(hits)):
            table.block_ids.append(self._take_free())
        return len(hits) * self.block_size

    def ensure_capacity(self, table: BlockTable, num_tokens: int) -> None:
        """Grow the table to hold num_tokens tokens."""
        need = self.blocks_for(num_tokens) - len(table.block_ids)
        if need > self.num_free:
            raise OutOfBlocksError(f"need {need} blocks, {self.num_free} free")
        for _ in range(need):
            table.block_ids.append(self._take_free())

    def can_grow(self, table: BlockTable, num_tokens: int) -> bool:
        """Whether ensure_capacity(table, num_tokens) and one copy-on-write fit now."""
        return self.blocks_for(num_tokens) - len(table.block_ids) + 1 <= self.num_free

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Release the blocks wholly past the first num_tokens tokens (the KV of
        rejected draft tokens). They were never hashed: only computed tokens are."""
        keep = self.blocks_for(num_tokens)
        assert keep >= table.num_hashed, "truncating a hashed block"
        if len(table.block_ids) > keep:
            tail = BlockTable(table.block_ids[keep:])
            del table.block_ids[keep:]
            self.free(tail)

    def make_writable(self, table: BlockTable, position: int) -> tuple[int, int] | None:
        """Copy-on-write: if the block that `position` falls in is shared with
        another table, give this table its own copy. Returns (source, copy) for
        the backend to copy, or None when the block was already private."""
        index = position // self.block_size
        shared = table.block_ids[index]
        if self.blocks[shared].ref_count == 1:
            return None
        if not self._free:
            raise OutOfBlocksError("need 1 block for copy-on-write, 0 free")
        copy = self._take_free()
        self.blocks[shared].ref_count -= 1
        table.block_ids[index] = copy
        table.num_hashed = min(table.num_hashed, index)
        return shared, copy

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table sharing every block (copy-on-write is the caller's job)."""
        for b in table.block_ids:
            self._ref(b)
        return BlockTable(list(table.block_ids), table.num_hashed)

    def free(self, table: BlockTable) -> None:
        # Release the tail first so the front of a sequence, the part most
        # likely shared with others, stays cached longest.
        for b in reversed(table.block_ids):
            block = self.blocks[b]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {b} freed twice"
            if block.ref_count == 0:
                self._free[b] = None
                if block.hash == NO_HASH:
                    self._free.move_to_end(b, last=False)
        table.block_ids.clear()
        table.num_hashed = 0
        table.num_from_host = 0

    def register_full_blocks(self, table: BlockTable, token_ids: Seq[int], num_computed: int,
                             salt: int | None = None) -> None:
        """Hash the blocks that are now completely computed, for reuse by others."""
        if not self.enable_reuse:
            return
        bs = self.block_size
        full = min(num_computed // bs, len(table.block_ids))
        if full <= table.num_hashed:  # most steps of a decoding sequence: no block newly full
            return
        prev = self.blocks[table.block_ids[table.num_hashed - 1]].hash if table.num_hashed else first_hash(salt)
        for i in range(table.num_hashed, full):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(prev, chunk)
            block = self.blocks[table.block_ids[i]]
            if block.hash == NO_HASH and h not in self._by_hash:
                if self.host is not None:
                    self.host.drop(h)  # computed again on the device: one tier holds it
                block.hash, block.token_ids = h, chunk
                self._by_hash[h] = block.block_id
                self._log("device", h)
            prev = h
        table.num_hashed = max(table.num_hashed, full)

    # -- internals -------------------------------------------------------------

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH:
            del self._by_hash[block.hash]
            self._evict(block_id, block.hash, block.token_ids)
            block.hash, block.token_ids = NO_HASH, ()
        block.ref_count = 1
        return block_id

    def _evict(self, block_id: int, h: int, token_ids: tuple[int, ...]) -> None:
        """A cached block's device copy is about to be overwritten: keep it on the host
        if there is a tier (and its load into this block is not still pending)."""
        slot = None
        if self.host is not None and self._loads.pop(block_id, None) is None:
            slot, dropped = self.host.store(h, token_ids)
            if dropped is not None:
                self._log(None, dropped)
        if slot is None:
            self._log(None, h)
            return
        self._offloads.append((block_id, slot))
        self.offloaded_blocks += 1
        self._log("host", h)

    def _load(self, slot: int, h: int, token_ids: tuple[int, ...]) -> int:
        """A free device block for a block the host tier held; its copy is pending."""
        block_id = self._take_free()
        block = self.blocks[block_id]
        block.hash, block.token_ids = h, token_ids
        self._by_hash[h] = block_id
        self._loads[block_id] = slot
        self._log("device", h)
        return block_id

    def _log(self, tier: Tier | None, h: int) -> None:
        if self._events is not None:
            self._events.append((tier, h))

    def take_transfers(self) -> KvTransfers | None:
        """The copies between tiers decided since the last call (None: none), for the
        backend to issue before the next forward. Host slots the loads read may be
        stored into from now on: the backend orders those writes after the reads."""
        if not self._offloads and not self._loads:
            return None
        off, loads = self._offloads, self._loads
        self._offloads, self._loads = [], {}
        assert self.host is not None
        self.host.release_loading()
        return KvTransfers(
            np.array([b for b, _ in off], dtype=np.int64), np.array([s for _, s in off], dtype=np.int64),
            np.array(list(loads.values()), dtype=np.int64), np.array(list(loads), dtype=np.int64),
        )  # fmt: skip

    def check_invariants(self, tables: Seq[BlockTable]) -> None:
        """Reference counts equal the tables' references; every other block is free."""
        counts = [0] * self.num_blocks
        for t in tables:
            for b in t.block_ids:
                counts[b] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, referenced {counts[block.block_id]} times"
            )
            free = block.block_id in self._free
            assert (block.ref_count == 0) == free, f"block {block.block_id} free-list mismatch"
        for h, b in self._by_hash.items():
            assert self.blocks[b].hash == h, f"hash index points at block {b} with another hash"
        if self.host is not None:
            self.host.check_invariants()
            assert not self.host.hashes() & set(self._by_hash), "a hash held in both tiers"

    def cached_hashes(self) -> set[int]:
        """Every hash the device tier holds (what replaying the event log from the start gives)."""
        return set(self._by_hash)

    def host_hashes(self) -> set[int]:
        """Every hash the host tier holds."""
        return set() if self.host is None else self.host.hashes()
