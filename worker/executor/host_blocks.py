"""The host tier of the KV cache: slots in host memory that keep full prefix blocks
the device pool evicted, so a later prompt with that prefix copies them back
instead of recomputing them.

Bookkeeping only; the backend holds the bytes (HostKvBackend). A slot is in exactly
one of three states: free; cached (holds a block's hash and tokens, in LRU order,
reused by a prefix hit and evicted least-recently-stored first); or loading (a hit
took it this step: its copy to the device is not issued yet, so nothing may be
stored in it until the block manager hands the step's copies to the backend).
"""

from __future__ import annotations

from collections import OrderedDict


class HostBlocks:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: slot 0 first
        self._cached: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # slot -> (hash, tokens)
        self._loading: list[int] = []
        self._by_hash: dict[int, int] = {}

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, h: int, token_ids: tuple[int, ...]) -> int | None:
        """The slot holding the block of hash h and these tokens, if any."""
        slot = self._by_hash.get(h)
        if slot is None or self._cached[slot][1] != token_ids:
            return None
        return slot

    def store(self, h: int, token_ids: tuple[int, ...]) -> tuple[int | None, int | None]:
        """A slot for a block leaving the device: a free one, else the least recently
        stored. Returns (slot, hash evicted to make room); slot None when every slot
        is loading (the block is dropped)."""
        evicted = None
        if self._free:
            slot = self._free.pop()
        elif self._cached:
            slot, (evicted, _) = self._cached.popitem(last=False)
            del self._by_hash[evicted]
        else:
            return None, None
        self._cached[slot] = (h, token_ids)
        self._by_hash[h] = slot
        return slot, evicted

    def take(self, slot: int) -> tuple[int, tuple[int, ...]]:
        """A prefix hit: the block leaves the tier (it moves to the device); the slot is
        loading until `release_loading`. Returns its hash and tokens."""
        h, token_ids = self._cached.pop(slot)
        del self._by_hash[h]
        self._loading.append(slot)
        return h, token_ids

    def drop(self, h: int) -> bool:
        """Forget the block of hash h (the device computed it again); whether it was here."""
        slot = self._by_hash.pop(h, None)
        if slot is None:
            return False
        del self._cached[slot]
        self._free.append(slot)
        return True

    def release_loading(self) -> None:
        """The step's copies are issued: the slots they read may be stored into again
        (the backend orders those writes after the reads)."""
        self._free.extend(self._loading)
        self._loading.clear()

    def hashes(self) -> set[int]:
        return set(self._by_hash)

    def check_invariants(self) -> None:
        """Every slot in exactly one of free, loading, cached; the index matches the cached."""
        free, loading, cached = set(self._free), set(self._loading), set(self._cached)
        assert len(free) == len(self._free) and len(loading) == len(self._loading), "a host slot listed twice"
        assert not (free & loading or free & cached or loading & cached), "a host slot in two states"
        assert free | loading | cached == set(range(self.num_blocks)), "a host slot in no state"
        assert {slot: h for h, slot in self._by_hash.items()} == {s: e[0] for s, e in self._cached.items()}, (
            "the host hash index does not match the cached slots"
        )
