"""KV block transfers between two processes on one GPU: frames (gather on the device,
one copy to the host, one ZeroMQ frame, one copy back, scatter) against CUDA IPC (gather
on the device, the handle over ZeroMQ, scatter device to device from the mapped buffer).

Each row moves N scattered blocks of a Llama-3.1-8B-shaped bf16 cache (32 layers, 8 KV
heads of 128, 32 tokens a block: 4 MiB a block) from one process's pool to scattered
blocks of the other's, and times from the sender's first copy to the receiver's ack
(the receiver's copies synchronized before it answers), as worker/service does it: the
same store, codec and sockets. Median of 5 after one warm-up. The last line is the
roofline: one device-to-device copy of the largest size in one process, same run.

    python -m bench.kv_transfer_bench            # on a CUDA host
    python -m bench.run kv_transfer

Needs torch, numpy, pyzmq, msgpack and pydantic.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch
import zmq

import protocol
from bench import SkipSection
from worker.executor.kv_export import CacheStore, KvBlocks, KvLayout
from worker.service.kv_transfer import KvPushers, cuda_ipc_of, from_frames, ipc_of, to_frames

TITLE = "KV transfer between two processes on one GPU: frames vs CUDA IPC"
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 32
POOL = 160  # blocks per process
SIZES = (1, 4, 16, 64)  # blocks: 4 MiB to 256 MiB
REPEATS = 5
LAYOUT = KvLayout("bench", LAYERS, BLOCK, KV_HEADS, HEAD_DIM, "bfloat16", 1)


class _Pool:
    """A KV pool as a backend's ops hold it."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        shape = (POOL, BLOCK, KV_HEADS, HEAD_DIM)
        self.k_cache = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        self.v_cache = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]


def _blocks(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).choice(POOL, n, replace=False).tolist()


def receive(address: str) -> None:
    """The decode side: write what comes into scattered blocks, then answer."""
    from worker.backends.torch_kv_ipc import open_buffer

    store = CacheStore(_Pool(1))
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(address)
    while True:
        sender, *frames = sock.recv_multipart()
        header, kv = from_frames(frames)
        if header.transfer_id == "stop":
            break
        ids = _blocks(header.num_blocks, 2)
        if header.cuda_ipc is not None:
            data: Any = open_buffer(ipc_of(header.cuda_ipc), time.time() - header.sent_at)
            store.write(ids, data)
            torch.cuda.synchronize()
            del data  # lets go of the sender's buffer before the answer
        else:
            store.write(ids, kv.data)
            torch.cuda.synchronize()
        sock.send_multipart([sender, protocol.encode(protocol.KvAck(transfer_id=header.transfer_id, opened=True))])
    sock.close(0)


def _send_once(store: CacheStore, pushers: KvPushers, address: str, n: int, ipc: bool) -> float:
    from worker.backends.torch_kv_ipc import share

    ids = _blocks(n, 3)
    tokens = tuple(range(n * BLOCK))
    began = time.perf_counter()
    if ipc:
        buffer = store.gather(ids)
        frames = to_frames("t", KvBlocks(LAYOUT, tokens, b""), cuda_ipc_of(share(buffer)))
    else:
        frames = to_frames("t", KvBlocks(LAYOUT, tokens, store.read(ids)))
    assert pushers.send(address, frames)
    while not pushers.acks():
        time.sleep(0.0001)
    seconds = time.perf_counter() - began
    if ipc:
        del buffer
    return seconds


def table() -> tuple[list[str], list[list[str]]]:
    if not torch.cuda.is_available():
        raise SkipSection("needs a CUDA device")
    address = f"ipc:///tmp/tokenwire-kv-bench-{time.time_ns()}"
    receiver = subprocess.Popen([sys.executable, "-m", "bench.kv_transfer_bench", "--receive", address])
    store = CacheStore(_Pool(0))
    pushers = KvPushers(zmq.Context.instance())
    rows = []
    try:
        for n in SIZES:
            size = n * LAYOUT.bytes_per_block
            cells = [f"{size / 2**20:.0f}", str(n)]
            times = {}
            for ipc in (False, True):
                runs = [_send_once(store, pushers, address, n, ipc) for _ in range(REPEATS + 1)][1:]
                times[ipc] = statistics.median(runs)
                cells += [f"{times[ipc] * 1e3:.2f}", f"{size / times[ipc] / 1e9:.1f}"]
            rows.append([*cells, f"{times[False] / times[True]:.1f}x"])
        pushers.send(address, to_frames("stop", KvBlocks(LAYOUT, (), b"")))
        receiver.wait(60)
    finally:
        pushers.close()
        if receiver.poll() is None:
            receiver.kill()
    rows.append(["device copy, one process", "", "", "", "", f"{_device_copy_gbs(SIZES[-1]):.1f}", ""])
    return ["MiB", "blocks", "frames ms", "frames GB/s", "cuda-ipc ms", "cuda-ipc GB/s", "speed-up"], rows


def _device_copy_gbs(n: int) -> float:
    src = torch.empty(n * LAYOUT.bytes_per_block, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(REPEATS):
        dst.copy_(src)
    torch.cuda.synchronize()
    return REPEATS * src.numel() / (time.perf_counter() - began) / 1e9


def main() -> None:
    from bench.run import format_table

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--receive", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.receive:
        receive(args.receive)
        return
    try:
        header, rows = table()
    except SkipSection as e:
        print(f"{TITLE}: skipped: {e}")
        return
    print(f"\n== {TITLE}")
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
