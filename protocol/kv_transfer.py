"""Disaggregated serving: a prompt prefilled on one worker and decoded on another.

A gateway sends a new request to a prefill worker with a `KvHandoff` naming the
decode worker's KV endpoint. The prefill worker computes the prompt and the first
token, streams that token as usual, sends the prompt's KV blocks to the decode
worker (a `KvTransfer` header, then the blocks as one frame of raw bytes, or no frame
and a CUDA IPC handle of a device buffer holding them; the decode worker answers a
handle with a `KvAck`) and tells the gateway `HandedOff` instead of sending a final
response. The gateway then sends the decode worker a continuation of the
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


# How a KvTransfer's blocks are laid out. 1: one frame per block and layer, K then V (no
# longer sent or read); 2: every block in one buffer, [num_layers, 2 (K, V), num_blocks,
# block_size, num_kv_heads, head_dim] in `dtype`, C order, so that each side moves it with
# one indexed copy per layer's K and V and one copy between host and device.
KV_FORMAT = 2


class CudaIpcBuffer(WireModel):
    """A device buffer the sender keeps for the receiver to copy from, until it answers with
    a KvAck or a timeout passes: what torch's `UntypedStorage._share_cuda_` gives, with the
    host and the GPU it is on (worker/backends/torch_kv_ipc.py)."""

    host_id: Name  # the sender's host name and boot id: a handle opens on that host only
    device_uuid: Name  # the GPU holding the buffer ("GPU-..."): its index differs between processes
    handle: bytes = Field(max_length=1024)  # the CUDA allocation's IPC handle
    offset: int = Field(ge=0)  # of the buffer in that allocation, bytes
    size: int = Field(ge=1)  # bytes
    ref_counter: Name  # torch's shared-memory reference counter of the allocation, and the slot in it
    ref_counter_offset: int = Field(ge=0)
    event_handle: bytes = Field(max_length=1024)  # what the receiver waits on before reading
    event_sync_required: bool


class KvTransfer(Message):
    """The first frame of a KV transfer, prefill worker to decode worker: the layout of the
    blocks and where they are. Without `cuda_ipc`, one frame follows: the blocks in format
    `kv_format` (KV_FORMAT). With it, nothing follows: the blocks, in that format, are in the
    sender's device buffer, and the receiver answers with a KvAck."""

    kind: ClassVar[str] = "kv_transfer"

    transfer_id: Name
    kv_format: int = Field(ge=1)  # KV_FORMAT; required, so that a sender of another format is refused by name
    model: Name
    num_layers: int = Field(ge=1)
    block_size: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)  # on one tensor-parallel rank
    head_dim: int = Field(ge=1)
    dtype: Name  # e.g. "float32", "bfloat16", "float8_e4m3fn"
    tensor_parallel_size: int = Field(1, ge=1)
    token_ids: TokenIds  # the tokens the blocks hold: block_size per block
    sent_at: float = 0.0  # the sender's unix time, for the transfer time the receiver reports
    cuda_ipc: CudaIpcBuffer | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.token_ids) // self.block_size


class KvAck(Message):
    """Decode worker to prefill worker, on the connection a KvTransfer with a CUDA IPC
    handle came in on: the blocks were copied and the sender's buffer may be freed
    (`opened`), or the handle could not be opened here and the blocks should come as a
    frame instead."""

    kind: ClassVar[str] = "kv_ack"

    transfer_id: Name
    opened: bool


class HandedOff(Message):
    """Prefill worker to gateway, in place of a final response: the request's first token
    was sent, and its KV blocks went to the decode worker its KvHandoff named (none where
    the prompt filled no block)."""

    kind: ClassVar[str] = "handed_off"

    request_id: Name
    transfer_id: Name
    num_blocks: int = Field(0, ge=0)
