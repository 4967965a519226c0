"""What a worker's KV cache holds, for gateways routing prompts to their prefix.

A worker numbers its KvEvents 1, 2, ... within one `incarnation` (a name it draws
at start): a gateway that sees a gap, a new incarnation, or has just connected
asks with KvSnapshotRequest and replaces what it held with the KvSnapshot. Hashes
are protocol.block_hash chains, packed as little-endian int64 on the wire.
"""

from __future__ import annotations

import sys
from array import array
from typing import Annotated, ClassVar

from pydantic import BeforeValidator, Field, PlainSerializer, SerializationInfo, ValidationInfo

from protocol.base import Message, Name
from protocol.packed import WIRE_CONTEXT, Unpacking

_LITTLE = sys.byteorder == "little"
if array("q").itemsize != 8:
    raise ImportError("protocol.kv_cache needs a platform with an 8-byte C long long")


def _from_wire(value: object, info: ValidationInfo) -> object:
    if type(value) is not bytes:
        return value
    if len(value) & 7:
        raise ValueError(f"packed int64 data is {len(value)} bytes, not a multiple of 8")
    budget = info.context
    if type(budget) is Unpacking:
        budget.remaining -= len(value) >> 3
        if budget.remaining < 0:
            raise ValueError(f"the message packs more than max_packed_values ({budget.limit}) numbers")
    a = array("q", value)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def _to_wire(value: list[int], info: SerializationInfo) -> list[int] | bytes:
    if info.context is not WIRE_CONTEXT:
        return value
    a = array("q", value)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


# Block hashes (signed 64-bit): int64 on the wire.
BlockHashes = Annotated[
    list[Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]],
    BeforeValidator(_from_wire),
    PlainSerializer(_to_wire),
]
Incarnation = Annotated[str, Field(min_length=1, max_length=64)]


class KvEvents(Message):
    """Worker -> every gateway: the block hashes its cache index gained and lost since
    event `seq - 1`, by tier: `stored` are in device memory now, `stored_host` in the
    host tier now (a hash that moved between tiers is listed under the one it is in),
    `removed` in neither. The lists are disjoint (a hash gained and lost within one
    message is in none), so they apply in any order."""

    kind: ClassVar[str] = "kv_events"

    sender_id: Name
    incarnation: Incarnation
    seq: int = Field(ge=1)
    stored: BlockHashes = Field(default_factory=list)
    removed: BlockHashes = Field(default_factory=list)
    stored_host: BlockHashes = Field(default_factory=list)


class KvSnapshot(Message):
    """Worker -> a gateway: every block hash its cache index holds, by tier, as of event `seq`
    (0: none yet), and the block size its prompts are hashed with. Sent after Ready
    and on request."""

    kind: ClassVar[str] = "kv_snapshot"

    sender_id: Name
    incarnation: Incarnation
    seq: int = Field(ge=0)
    block_size: int = Field(ge=1)
    hashes: BlockHashes = Field(default_factory=list)  # in device memory
    host_hashes: BlockHashes = Field(default_factory=list)  # in the host tier


class KvSnapshotRequest(Message):
    """Gateway -> worker: send me a KvSnapshot (my copy of your index has a gap)."""

    kind: ClassVar[str] = "kv_snapshot_request"

    sender_id: Name
