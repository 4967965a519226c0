"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, prefix reuse.

A block that fills up gets a hash chained over every token before it, so two
sequences with the same prefix map it to the same physical block. Freed blocks
keep their hash and contents until the allocator needs them: those are the
"cached" blocks, reused on a hash hit and evicted least-recently-freed first.

With the event log on (`record_events`), every hash that enters or leaves the
cache index is logged in order, for whoever drives the core to publish: a
gateway mirrors each worker's index from it to route prompts to their prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from protocol.block_hash import NO_HASH, chain_hash, first_hash

# An entry of the event log: (True, hash) the hash entered the cache index, (False, hash) it left.
BlockEvent = tuple[bool, int]


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


class OutOfBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_reuse: bool = True) -> None:
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
        self.reused_blocks = 0  # cumulative prefix-cache hits
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

    def cached_prefix(self, token_ids: Seq[int], salt: int | None = None) -> list[int]:
        """Block ids that hold a prefix of token_ids, never the whole sequence:
        the last token is always recomputed, since its logits are needed."""
        if not self.enable_reuse:
            return []
        hits: list[int] = []
        prev = first_hash(salt)
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            chunk = token_ids[start : start + bs]
            h = chain_hash(prev, chunk)
            block_id = self._by_hash.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(chunk):
                break
            hits.append(block_id)
            prev = h
        return hits

    # -- allocation ------------------------------------------------------------

    def allocate_prompt(self, table: BlockTable, token_ids: Seq[int], num_tokens: int,
                        salt: int | None = None) -> int:
        """Give an empty table blocks for num_tokens tokens, reusing cached prefix
        blocks. Returns how many leading tokens are already in the cache."""
        assert not table.block_ids, "allocate_prompt needs an empty block table"
        hits = self.cached_prefix(token_ids, salt)
        need_new = self.blocks_for(num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if need_new > self.num_free - revived:
            raise OutOfBlocksError(f"need {need_new} blocks, {self.num_free - revived} free")
        for b in hits:
            self._ref(b)
        self.reused_blocks += len(hits)
        table.block_ids.extend(hits)
        table.num_hashed = len(hits)
        for _ in range(need_new):
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
                block.hash, block.token_ids = h, chunk
                self._by_hash[h] = block.block_id
                if self._events is not None:
                    self._events.append((True, h))
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
            if self._events is not None:
                self._events.append((False, block.hash))
            block.hash, block.token_ids = NO_HASH, ()
        block.ref_count = 1
        return block_id

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

    def cached_hashes(self) -> set[int]:
        """Every hash the index holds (what replaying the event log from the start gives)."""
        return set(self._by_hash)
