"""KV transfer messages (worker/service/kv_transfer.py): a header and one frame of raw
bytes that read back as the blocks sent, a header alone for blocks shared by CUDA IPC,
and every malformed message refused with what is wrong."""

from __future__ import annotations

import pytest

import protocol
from worker.executor.kv_export import KvBlocks, KvLayout
from worker.executor.kv_shared import IpcBuffer
from worker.service.kv_transfer import KvTransferError, cuda_ipc_of, from_frames, ipc_of, to_frames

LAYOUT = KvLayout("tiny", num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32",
                  tensor_parallel_size=1)  # fmt: skip
BLOCK = 2 * 2 * 4 * 2 * 8 * 4  # K and V of two layers: block_size x heads x head_dim float32 each
SHARED = IpcBuffer(host_id="h/boot", device_uuid="GPU-1", handle=b"\x01" * 64, offset=512, size=3 * BLOCK,
                 ref_counter="/torch_1_2_3", ref_counter_offset=4, event_handle=b"\x02" * 64,
                 event_sync_required=True)  # fmt: skip


def blocks(n: int) -> KvBlocks:
    return KvBlocks(LAYOUT, tuple(range(100, 100 + 4 * n)), bytes(range(256)) * (n * BLOCK // 256))


def test_frames_read_back_as_the_blocks_sent() -> None:
    sent = blocks(3)
    frames = to_frames("t1", sent)
    assert len(frames) == 2  # the header, then every block in one frame
    header, got = from_frames(frames)
    assert header.transfer_id == "t1" and header.num_blocks == 3 and header.kv_format == protocol.KV_FORMAT
    assert header.cuda_ipc is None
    assert got == sent


def test_blocks_shared_by_cuda_ipc_are_a_header_alone_naming_the_buffer() -> None:
    frames = to_frames("t2", blocks(3), cuda_ipc_of(SHARED))
    assert len(frames) == 1
    header, got = from_frames(frames)
    assert header.cuda_ipc is not None and ipc_of(header.cuda_ipc) == SHARED
    assert got.token_ids == blocks(3).token_ids and got.data == b""


def test_a_shared_buffer_of_the_wrong_size_is_refused() -> None:
    shared = cuda_ipc_of(SHARED).model_copy(update={"size": 2 * BLOCK})
    with pytest.raises(KvTransferError, match=f"are {3 * BLOCK} bytes; the CUDA IPC buffer holds {2 * BLOCK}"):
        from_frames(to_frames("t2", blocks(3), shared))
    with pytest.raises(KvTransferError, match="is its header alone; got 1 more frames"):
        from_frames([*to_frames("t2", blocks(3), cuda_ipc_of(SHARED)), b"x"])


def test_a_frame_missing_or_of_the_wrong_size_is_refused() -> None:
    frames = to_frames("t1", blocks(2))
    with pytest.raises(KvTransferError, match="a header and one frame of blocks; got 1 frames"):
        from_frames(frames[:-1])
    with pytest.raises(KvTransferError, match=f"2 blocks of this layout are {2 * BLOCK} bytes; the frame holds "
                                              f"{2 * BLOCK - 1}"):  # fmt: skip
        from_frames([frames[0], frames[1][:-1]])


def test_another_format_is_refused_by_its_number() -> None:
    frames = to_frames("t1", blocks(1))
    header = protocol.decode(frames[0])
    assert isinstance(header, protocol.KvTransfer)
    frames[0] = protocol.encode(header.model_copy(update={"kv_format": 1}))
    with pytest.raises(KvTransferError, match=f"KV transfer format 1; this worker reads format {protocol.KV_FORMAT}"):
        from_frames(frames)


def test_a_header_that_is_not_a_kv_transfer_is_refused() -> None:
    with pytest.raises(KvTransferError, match="starts with a kv_transfer header, not heartbeat"):
        from_frames([protocol.encode(protocol.Heartbeat(sender_id="w"))])
    with pytest.raises(KvTransferError, match=r"^KV transfer header: "):
        from_frames([b"\xc1junk"])


def test_token_ids_that_do_not_fill_blocks_are_refused() -> None:
    frames = to_frames("t1", blocks(1))
    header = protocol.decode(frames[0])
    assert isinstance(header, protocol.KvTransfer)
    frames[0] = protocol.encode(header.model_copy(update={"token_ids": header.token_ids[:-1]}))
    with pytest.raises(KvTransferError, match="3 token ids do not fill blocks of 4"):
        from_frames(frames)
