"""KV blocks between workers over ZeroMQ: one message per request, a msgpack
`protocol.KvTransfer` header and then every block in one frame of raw bytes (the
frames transport), or the header alone naming a CUDA IPC handle of a device buffer
with the blocks (the cuda-ipc transport, worker/backends/torch_kv_ipc.py), which the
decode side answers with a `protocol.KvAck`. Nothing is pickled; the receiver writes
the bytes as they came.

The prefill side sends on DEALER sockets, one per decode endpoint, connected on first
use, and reads the acks on them; the decode side binds a ROUTER whose address it
registers (`kv_address`) and answers on it. A malformed message is refused with a
`KvTransferError` naming the problem; a layout that is not the receiver's is refused
by the engine (worker/executor/kv_export.py).
"""

from __future__ import annotations

import logging
import time

import zmq

import protocol
from worker.executor.kv_export import KvBlocks, KvLayout
from worker.executor.kv_shared import IpcBuffer

log = logging.getLogger(__name__)


class KvTransferError(ValueError):
    """A KV transfer message that cannot be read; the text says why."""


def to_frames(transfer_id: str, kv: KvBlocks, cuda_ipc: protocol.CudaIpcBuffer | None = None,
              limits: protocol.Limits = protocol.DEFAULT_LIMITS) -> list[bytes]:  # fmt: skip
    """The message of a transfer: the header, then the blocks' bytes (none where they are
    shared by `cuda_ipc`)."""
    layout = kv.layout
    header = protocol.KvTransfer(
        transfer_id=transfer_id,
        kv_format=protocol.KV_FORMAT,
        model=layout.model,
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        tensor_parallel_size=layout.tensor_parallel_size,
        token_ids=list(kv.token_ids),
        sent_at=time.time(),
        cuda_ipc=cuda_ipc,
    )
    encoded = protocol.encode(header, limits)
    return [encoded] if cuda_ipc is not None else [encoded, kv.data]


def from_frames(
    frames: list[bytes], limits: protocol.Limits = protocol.DEFAULT_LIMITS
) -> tuple[protocol.KvTransfer, KvBlocks]:
    """The header and the blocks of one transfer message; where the header names a CUDA
    IPC buffer, the blocks' `data` is empty and the buffer is the header's."""
    try:
        header = protocol.decode(frames[0], limits)
    except protocol.ProtocolError as e:
        raise KvTransferError(f"KV transfer header: {e}") from None
    if not isinstance(header, protocol.KvTransfer):
        raise KvTransferError(f"a KV transfer starts with a kv_transfer header, not {header.kind}")
    if header.kv_format != protocol.KV_FORMAT:
        raise KvTransferError(f"KV transfer format {header.kv_format}; this worker reads format {protocol.KV_FORMAT}")
    layout = KvLayout(header.model, header.num_layers, header.block_size, header.num_kv_heads, header.head_dim,
                      header.dtype, header.tensor_parallel_size)  # fmt: skip
    if len(header.token_ids) % header.block_size:
        raise KvTransferError(f"{len(header.token_ids)} token ids do not fill blocks of {header.block_size}")
    size = header.num_blocks * layout.bytes_per_block
    if header.cuda_ipc is not None:
        if len(frames) != 1:
            raise KvTransferError(f"a KV transfer by CUDA IPC is its header alone; got {len(frames) - 1} more frames")
        if header.cuda_ipc.size != size:
            raise KvTransferError(f"{header.num_blocks} blocks of this layout are {size} bytes; "
                                  f"the CUDA IPC buffer holds {header.cuda_ipc.size}")  # fmt: skip
        return header, KvBlocks(layout, tuple(header.token_ids), b"")
    if len(frames) != 2:
        raise KvTransferError(f"a KV transfer is a header and one frame of blocks; got {len(frames)} frames")
    if len(frames[1]) != size:
        raise KvTransferError(f"{header.num_blocks} blocks of this layout are {size} bytes; the frame holds "
                              f"{len(frames[1])}")  # fmt: skip
    return header, KvBlocks(layout, tuple(header.token_ids), frames[1])


def cuda_ipc_of(shared: IpcBuffer) -> protocol.CudaIpcBuffer:
    return protocol.CudaIpcBuffer(**{name: getattr(shared, name) for name in IpcBuffer.__dataclass_fields__})


def ipc_of(shared: protocol.CudaIpcBuffer) -> IpcBuffer:
    return IpcBuffer(**{name: getattr(shared, name) for name in IpcBuffer.__dataclass_fields__})


class KvPushers:
    """The prefill side's DEALER sockets, one per decode endpoint, and the acks that come
    back on them. A decode worker that is gone leaves its messages queued up to the
    high-water mark, then dropped: the gateway's continuation recomputes what did not
    arrive."""

    def __init__(self, ctx: zmq.Context, limits: protocol.Limits = protocol.DEFAULT_LIMITS) -> None:
        self.ctx = ctx
        self.limits = limits
        self._sockets: dict[str, zmq.Socket] = {}

    def send(self, address: str, frames: list[bytes]) -> bool:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._sockets[address] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 64)
            sock.connect(address)
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def acks(self) -> list[tuple[str, protocol.KvAck]]:
        """The acks waiting on every socket, with the address each came from."""
        got = []
        for address, sock in self._sockets.items():
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    ack = protocol.decode(frames[0], self.limits)
                except protocol.ProtocolError as e:
                    log.warning("refused a KV ack from %s: %s", address, e)
                    continue
                if isinstance(ack, protocol.KvAck):
                    got.append((address, ack))
        return got

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(0)
        self._sockets.clear()
