"""The hash of a full KV block: chained over every token before it, so a prompt's
blocks form a chain and two sequences share a block only if they share the whole
prefix up to its end.

Both sides of the wire compute it: the block manager keys its prefix cache by it,
and a gateway hashes a prompt the same way to find the worker whose cache holds
the longest part of it. So it must not vary between processes or hosts: BLAKE2b
over the little-endian int64 tokens, not Python's `hash` (whose salting of strings
differs per process). It is one of protocol's pure-data modules (standard library
only), which the executor loads without the wire's pydantic and msgpack.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

NO_HASH = -1  # a block not (yet) full, or not hashed: never in a cache index


def chain_hash(prev_hash: int, token_ids: Sequence[int]) -> int:
    """A signed 64-bit hash of one block's tokens, chained from the block before it."""
    data = struct.pack(f"<q{len(token_ids)}q", prev_hash, *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def first_hash(salt: int | None) -> int:
    """What a sequence's first block chains from: blocks computed under another salt
    (LoRA adapter, prompt-tuning table) never match."""
    # The salt is hashed with a tag of its own, so it never equals a block's hash.
    return NO_HASH if salt is None else chain_hash(-2, (salt & (2**63 - 1),))


def prompt_hashes(token_ids: Sequence[int], block_size: int, salt: int | None = None) -> list[int]:
    """The chain of a prompt's blocks that a cache may hold for it: the full blocks
    before its last token (the last token is always computed, for its logits)."""
    hashes: list[int] = []
    prev = first_hash(salt)
    for start in range(0, len(token_ids) - block_size, block_size):
        prev = chain_hash(prev, token_ids[start : start + block_size])
        hashes.append(prev)
    return hashes
