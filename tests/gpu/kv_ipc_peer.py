"""One side of a KV transfer by CUDA IPC, in a process of its own (test_kv_ipc_gpu.py
starts both): an engine core on CUDA with the engine process's KV code (EngineKv), the
wire messages (worker/service/kv_transfer.py) on the sockets the worker uses, DEALER to
ROUTER. Prints its findings as one JSON line.

    python -m tests.gpu.kv_ipc_peer prefill CHECKPOINT ADDRESS
    python -m tests.gpu.kv_ipc_peer decode CHECKPOINT ADDRESS FIRST_TOKEN copy|refuse
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
import zmq

import protocol
from worker.executor import EngineCore, ExecutorConfig, KvCacheConfig, Request
from worker.service.engine_kv import EngineKv, KvExported
from worker.service.kv_transfer import KvPushers, cuda_ipc_of, from_frames, ipc_of, to_frames

PROMPT = [11, 52, 7, 300, 41, 9, 18, 77, 5, 123, 64, 12, 3, 99, 250, 31, 8, 14]  # 4 full blocks of 4 and 2 tokens
MAX_TOKENS = 8
WAIT_MS = 120_000


def core_of(checkpoint: str) -> EngineCore:
    config = ExecutorConfig(backend="torch", device="cuda", deterministic=True, max_num_tokens=16,
                            kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=256))  # fmt: skip
    return EngineCore.from_model(checkpoint, config)


def prefill(checkpoint: str, address: str) -> dict[str, Any]:
    core = core_of(checkpoint)
    kv = EngineKv(core)
    kv.watch(1, PROMPT, "tiny", "cuda_ipc")
    core.add_requests([(1, Request(PROMPT, 1, end_id=-1))])
    exported: list[KvExported] = []
    while core.has_work:
        exported += kv.exports(core.step())
    (export,) = exported
    assert export.kv is not None and export.ipc is not None, export
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    shared = kv.shared
    pushers = KvPushers(zmq.Context.instance())
    frames = to_frames("t1", export.kv, cuda_ipc_of(export.ipc))
    assert pushers.send(address, frames)
    ack = _ack(pushers)
    resent = kv.returned(1, "copied" if ack.opened else "refused")
    if resent is not None:
        assert resent.kv is not None
        assert pushers.send(address, to_frames("t1", resent.kv))
        _ack(pushers)  # the frames were taken: the socket may close
    torch.cuda.synchronize()
    freed = held - torch.cuda.memory_allocated()
    pushers.close()
    return {"frames_sent": len(frames), "num_bytes": export.kv.num_bytes, "shared": shared, "shared_after": kv.shared,
            "opened": ack.opened, "freed": freed, "resent": resent is not None}  # fmt: skip


def _ack(pushers: KvPushers) -> protocol.KvAck:
    deadline = time.monotonic() + WAIT_MS / 1000
    while time.monotonic() < deadline:
        for _, ack in pushers.acks():
            return ack
        time.sleep(0.001)
    raise TimeoutError("no KvAck came")


def decode(checkpoint: str, address: str, first: int, how: str) -> dict[str, Any]:
    core = core_of(checkpoint)
    kv = EngineKv(core)
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(address)
    assert sock.poll(WAIT_MS), "no transfer came"
    sender, *frames = sock.recv_multipart()
    header, blocks = from_frames(frames)
    assert header.cuda_ipc is not None, "the transfer came as frames"
    if how == "copy":
        done = kv.import_(header.transfer_id, "tiny", blocks, ipc_of(header.cuda_ipc), time.time() - header.sent_at)
        sock.send_multipart([sender, protocol.encode(protocol.KvAck(transfer_id="t1", opened=done.opened))])
    else:  # as a decode worker that cannot open the handle answers
        sock.send_multipart([sender, protocol.encode(protocol.KvAck(transfer_id="t1", opened=False))])
        assert sock.poll(WAIT_MS), "no frames came after the refusal"
        sender, *frames = sock.recv_multipart()
        header, blocks = from_frames(frames)
        done = kv.import_(header.transfer_id, "tiny", blocks)
        sock.send_multipart([sender, protocol.encode(protocol.KvAck(transfer_id="t1", opened=True))])
    reused = core.blocks.reused_blocks
    core.add_requests([(1, Request(PROMPT, MAX_TOKENS, streaming=True, end_id=-1, resumed_token_ids=[first]))])
    tokens = [first]
    while core.has_work:
        for r in core.step().all_responses():
            assert r.result is not None, r.error_msg
            tokens += r.result.output_token_ids[0]
    time.sleep(0.5)  # the last ack leaves before the socket closes
    sock.close(0)
    return {"ipc": done.ipc, "opened": done.opened, "error": done.error, "num_blocks": done.num_blocks,
            "via_frames": header.cuda_ipc is None, "reused": core.blocks.reused_blocks - reused,
            "tokens": tokens}  # fmt: skip


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    found = prefill(*args) if role == "prefill" else decode(args[0], args[1], int(args[2]), args[3])
    print(json.dumps(found))
