"""KV blocks shared to another process on the same host by CUDA IPC: the prefill side
gathers a prompt's blocks into one device buffer and shares it; the decode side maps
that buffer and copies it device to device into its own blocks, with no trip through
the host or the network.

Why through torch's storage sharing: the buffer comes from torch's caching allocator,
so only torch knows which cudaMalloc allocation holds it and at what offset, and torch
already keeps a shared buffer alive while another process holds it (a reference counter
in a shared-memory file, decremented by the receiver when it lets go). `_share_cuda_`
and `_new_shared_cuda` are what `torch.multiprocessing.reductions` sends CUDA tensors
with; they are private names, stable through torch 2.x (the 8-field tuple, the counter
release `_release_ipc_counter_cuda`). We call them directly instead of pickling through
`reduce_tensor`, because the handle crosses a network socket, where nothing is
unpickled: every field is a plain value on the wire (protocol.CudaIpcBuffer).

torch's counter keeps a buffer alive for a receiver that never lets go, and a receiver
that dies or never opens the handle never lets go. So the sender does not rely on it
alone: it holds each buffer until the receiver acknowledges, or until a timeout
passes (worker/executor/kv_shared.py), and then releases the receiver's count itself (`give_up`) so the memory goes
back to the allocator. A receiver opens only handles younger than `OPEN_WITHIN_S`, well
inside that time, so a buffer is never freed under a copy.

Limits: one host (a handle is a driver object of that host), processes that share the
IPC namespace and /dev/shm (containers need --ipc=host), and the caching allocator's
ordinary segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True shares differently
in some torch versions; opening then fails and the transfer goes as frames).
"""

from __future__ import annotations

import re
import socket
from functools import cache
from pathlib import Path

import torch

from worker.executor.kv_shared import IpcBuffer

# A receiver opens no handle older than this (on the host's one clock): a third of the time
# the sender keeps a buffer unanswered (worker/executor/kv_shared.py's SHARED_FOR_S).
OPEN_WITHIN_S = 10.0
_REF_COUNTER = re.compile(r"/torch_[0-9_]+")  # the shared-memory file names torch gives its counters


class KvIpcError(RuntimeError):
    """A CUDA IPC handle that cannot be opened here; the text says why."""


@cache
def host_id() -> str:
    """This host's name and boot id: two processes may exchange handles only where both agree."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


def device_uuids() -> tuple[str, ...]:
    """The UUIDs of the GPUs this process sees, by device index."""
    if not torch.cuda.is_available():
        return ()
    return tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))


def share(buffer: torch.Tensor) -> IpcBuffer:
    """Share a CUDA buffer that owns its whole storage. Its kernels queued so far are
    what the receiver sees: torch records an event after them that the receiver waits on."""
    storage = buffer.untyped_storage()
    if buffer.storage_offset() or storage.nbytes() != buffer.numel() * buffer.element_size():
        raise ValueError("share() takes a buffer that is its whole storage")
    _, handle, size, offset, ref_counter, ref_offset, event, sync = storage._share_cuda_()
    return IpcBuffer(host_id(), device_uuids()[buffer.device.index or 0], handle, offset, size,
                     ref_counter.decode(), ref_offset, event, bool(sync))  # fmt: skip


def open_buffer(shared: IpcBuffer, age_s: float) -> torch.Tensor:
    """The uint8 tensor of another process's shared buffer, `age_s` seconds after it was
    shared; KvIpcError where it cannot be opened here. Let go of it (drop every reference)
    once the copies out of it are done: that releases the sender's memory."""
    if shared.host_id != host_id():
        raise KvIpcError(f"the buffer is on host {shared.host_id!r}, not this one ({host_id()!r})")
    if age_s > OPEN_WITHIN_S:
        raise KvIpcError(f"the handle is {age_s:.1f} s old; handles are opened within {OPEN_WITHIN_S:.0f} s")
    if not _REF_COUNTER.fullmatch(shared.ref_counter):
        raise KvIpcError(f"{shared.ref_counter!r} is not a reference counter torch names")
    uuids = device_uuids()
    if shared.device_uuid not in uuids:
        raise KvIpcError(f"GPU {shared.device_uuid} is not visible to this process")
    index = uuids.index(shared.device_uuid)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index, shared.handle, shared.size, shared.offset, shared.ref_counter.encode(),
            shared.ref_counter_offset, shared.event_handle, shared.event_sync_required,
        )  # fmt: skip
    except RuntimeError as e:  # the driver's refusal: another IPC namespace, a stale or foreign handle
        raise KvIpcError(f"CUDA could not open the handle: {e}") from None
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage, 0, (shared.size,), (1,))


def give_up(shared: IpcBuffer) -> None:
    """Release the receiver's count on a buffer it never opened, or never let go of (it
    died, or was too late): the sender's memory is then freed when the sender drops it."""
    torch.UntypedStorage._release_ipc_counter_cuda(shared.ref_counter.encode(), shared.ref_counter_offset)
