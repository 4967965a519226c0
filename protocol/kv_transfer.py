"""Disaggregated serving: a prompt prefilled on one worker and decoded on another.

A gateway sends a new request to a prefill worker with a `KvHandoff` naming the
decode worker's KV endpoint. The prefill worker computes the prompt and the first
token, streams that token as usual, pushes the prompt's KV blocks to the decode
worker (one multi-frame ZeroMQ message: a `KvTransfer` header, then each block's K
and V per layer as raw bytes) and tells the gateway `HandedOff` instead of sending a
final response. The gateway then sends the decode worker a continuation of the
request (`resumed_token_ids`: the first token) that names the transfer, so the decode
worker waits briefly for the blocks if the continuation overtakes them.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from protocol.base import Message, Name, WireModel
from protocol.packed import TokenIds


class KvHandoff(WireModel):
    """On a Submit to a prefill worker: where its KV blocks go once its first token is out."""

    transfer_id: Name  # unique among every gateway's requests in flight (a hash of the gateway's id and its wire id)
    kv_address: Name  # the decode worker's KV endpoint (its registry entry's `kv_address`)


class KvTransfer(Message):
    """The first frame of a KV transfer, prefill worker to decode worker: the layout the
    frames after it are in. Then `num_blocks` x 2 x `num_layers` frames: block by block,
    K then V of each layer, [block_size, num_kv_heads, head_dim] in `dtype`, C order."""

    kind: ClassVar[str] = "kv_transfer"

    transfer_id: Name
    model: Name
    num_layers: int = Field(ge=1)
    block_size: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)  # on one tensor-parallel rank
    head_dim: int = Field(ge=1)
    dtype: Name  # e.g. "float32", "bfloat16", "float8_e4m3fn"
    tensor_parallel_size: int = Field(1, ge=1)
    token_ids: TokenIds  # the tokens the blocks hold: block_size per block
    sent_at: float = 0.0  # the sender's unix time, for the transfer time the receiver reports

    @property
    def num_blocks(self) -> int:
        return len(self.token_ids) // self.block_size


class HandedOff(Message):
    """Prefill worker to gateway, in place of a final response: the request's first token
    was sent, and its KV blocks went to the decode worker its KvHandoff named (none where
    the prompt filled no block)."""

    kind: ClassVar[str] = "handed_off"

    request_id: Name
    transfer_id: Name
    num_blocks: int = Field(0, ge=0)
