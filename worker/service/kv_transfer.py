"""KV blocks between workers over ZeroMQ (the CPU path): one multi-frame message per
request, a msgpack `protocol.KvTransfer` header and then each block's K and V per layer
as raw bytes, so nothing is pickled and the receiver writes the frames as they came.

The prefill side pushes (PUSH, one socket per decode endpoint, connected on first
use); the decode side binds a PULL socket whose address it registers (`kv_address`).
A malformed message is refused with a `KvTransferError` naming the problem; a layout
that is not the receiver's is refused by the engine (worker/executor/kv_export.py).
"""

from __future__ import annotations

import time

import zmq

import protocol
from worker.executor.kv_export import KvBlocks, KvLayout


class KvTransferError(ValueError):
    """A KV transfer message that cannot be read; the text says why."""


def to_frames(transfer_id: str, kv: KvBlocks, limits: protocol.Limits = protocol.DEFAULT_LIMITS) -> list[bytes]:
    layout = kv.layout
    header = protocol.KvTransfer(
        transfer_id=transfer_id,
        model=layout.model,
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        tensor_parallel_size=layout.tensor_parallel_size,
        token_ids=list(kv.token_ids),
        sent_at=time.time(),
    )
    return [protocol.encode(header, limits), *(frame for block in kv.frames for frame in block)]


def from_frames(
    frames: list[bytes], limits: protocol.Limits = protocol.DEFAULT_LIMITS
) -> tuple[protocol.KvTransfer, KvBlocks]:
    """The header and the blocks of one transfer message."""
    try:
        header = protocol.decode(frames[0], limits)
    except protocol.ProtocolError as e:
        raise KvTransferError(f"KV transfer header: {e}") from None
    if not isinstance(header, protocol.KvTransfer):
        raise KvTransferError(f"a KV transfer starts with a kv_transfer header, not {header.kind}")
    layout = KvLayout(header.model, header.num_layers, header.block_size, header.num_kv_heads, header.head_dim,
                      header.dtype, header.tensor_parallel_size)  # fmt: skip
    if len(header.token_ids) % header.block_size:
        raise KvTransferError(f"{len(header.token_ids)} token ids do not fill blocks of {header.block_size}")
    per_block = 2 * header.num_layers
    data = frames[1:]
    if len(data) != header.num_blocks * per_block:
        raise KvTransferError(f"{header.num_blocks} blocks of {header.num_layers} layers need "
                              f"{header.num_blocks * per_block} frames; got {len(data)}")  # fmt: skip
    frame_bytes = layout.bytes_per_block // per_block
    if any(len(f) != frame_bytes for f in data):
        raise KvTransferError(f"every frame must be {frame_bytes} bytes (one layer's K or V of one block)")
    blocks = [data[i : i + per_block] for i in range(0, len(data), per_block)]
    return header, KvBlocks(layout, tuple(header.token_ids), blocks)


class KvPushers:
    """The prefill side's PUSH sockets, one per decode endpoint. A decode worker that is
    gone leaves its messages queued up to the high-water mark, then dropped: the
    gateway's continuation recomputes what did not arrive."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self._sockets: dict[str, zmq.Socket] = {}

    def send(self, address: str, frames: list[bytes]) -> bool:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._sockets[address] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 64)
            sock.connect(address)
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(0)
        self._sockets.clear()
