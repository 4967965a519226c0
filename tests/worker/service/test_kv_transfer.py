"""KV transfer messages (worker/service/kv_transfer.py): a header and raw frames that read
back as the blocks sent, and every malformed message refused with what is wrong."""

from __future__ import annotations

import pytest

import protocol
from worker.executor.kv_export import KvBlocks, KvLayout
from worker.service.kv_transfer import KvTransferError, from_frames, to_frames

LAYOUT = KvLayout("tiny", num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32",
                  tensor_parallel_size=1)  # fmt: skip
FRAME = 4 * 2 * 8 * 4  # one layer's K (or V) of one block: block_size x heads x head_dim float32


def blocks(n: int) -> KvBlocks:
    frames = [[bytes([b * 4 + f]) * FRAME for f in range(4)] for b in range(n)]
    return KvBlocks(LAYOUT, tuple(range(100, 100 + 4 * n)), frames)


def test_frames_read_back_as_the_blocks_sent() -> None:
    sent = blocks(3)
    frames = to_frames("t1", sent)
    assert len(frames) == 1 + 3 * 2 * 2  # the header, then K and V of two layers per block
    header, got = from_frames(frames)
    assert header.transfer_id == "t1" and header.num_blocks == 3
    assert got == sent


def test_a_frame_missing_is_refused() -> None:
    frames = to_frames("t1", blocks(2))
    with pytest.raises(KvTransferError, match="2 blocks of 2 layers need 8 frames; got 7"):
        from_frames(frames[:-1])


def test_a_frame_of_the_wrong_size_is_refused() -> None:
    frames = to_frames("t1", blocks(1))
    frames[2] = frames[2][:-1]
    with pytest.raises(KvTransferError, match=f"every frame must be {FRAME} bytes"):
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
