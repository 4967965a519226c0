"""LoRA adapters on running workers: load and unload one over the worker's own socket
(a LoraLoad or LoraUnload, answered by LoraAdapters or an ErrorReply), and list them
from the Redis registry, where each worker's entry names the adapters it holds.

The worker tells its gateways itself when its adapters change, so they route
requests for a newly loaded adapter to it from then on.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import zmq

import protocol
from ops.curve import KeyPair, connect_as_client


class LoraControlError(RuntimeError):
    """The worker refused the load or unload; the text says why (a bad adapter, LoRA off)."""


def registered_workers(redis_url: str, prefix: str = protocol.DEFAULT_PREFIX) -> list[protocol.WorkerInfo]:
    """The live workers' registry entries, by worker id."""
    import redis

    keys = protocol.Keys(prefix)
    r: Any = redis.Redis.from_url(redis_url, socket_timeout=5)
    ids = [raw.decode() for raw in r.zrange(keys.workers(), 0, -1)]
    blobs = r.mget([keys.worker(i) for i in ids]) if ids else []
    infos = [protocol.decode(blob) for blob in blobs if blob is not None]
    return sorted((i for i in infos if isinstance(i, protocol.WorkerInfo)), key=lambda i: i.worker_id)


def change_lora(address: str, msg: protocol.LoraLoad | protocol.LoraUnload, *, timeout_s: float = 120.0,
                curve: tuple[KeyPair, bytes] | None = None) -> list[str]:  # fmt: skip
    """Send a load or unload to the worker at `address` and wait for its answer: the
    adapters it holds now. `curve`: this side's key pair (one the worker accepts, as a
    gateway's) and the worker's public key. Raises LoraControlError, or TimeoutError."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"lora-control-{uuid.uuid4().hex}".encode())  # never a gateway's id
    if curve is not None:
        connect_as_client(sock, *curve)
    try:
        sock.connect(address)
        sock.send(protocol.encode(msg))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000)):
                break
            answer = protocol.decode(sock.recv())
            if getattr(answer, "request_id", None) != msg.request_id:
                continue  # heartbeats, and other peers' news
            if isinstance(answer, protocol.ErrorReply):
                raise LoraControlError(answer.message)
            if isinstance(answer, protocol.LoraAdapters):
                return list(answer.adapters)
        raise TimeoutError(f"the worker at {address} did not answer the {msg.kind} within {timeout_s:g} s")
    finally:
        sock.close(0)
