"""How a prefill worker sends a hand-off's KV blocks to a decode worker (--kv-transfer).

- `frames`: the blocks as one ZeroMQ frame of host bytes; works between any two workers.
- `cuda-ipc`: the blocks stay in a device buffer whose CUDA IPC handle is sent instead
  (worker/backends/torch_kv_ipc.py); the decode worker copies GPU to GPU. Same host only.
- `auto` (the default): CUDA IPC where it can work, frames elsewhere: this worker's KV
  cache is on CUDA, the decode worker's address is on this host, and that worker has not
  refused a handle of ours before.

Whatever is chosen, a decode worker that cannot open a handle (another host, a GPU it
does not see, another IPC namespace) says so, and that transfer goes as frames; under
`auto` that worker then gets frames from the start.
"""

from __future__ import annotations

import socket
from typing import Literal
from urllib.parse import urlsplit

Mode = Literal["auto", "frames", "cuda-ipc"]  # the operator's choice
Transport = Literal["frames", "cuda_ipc"]  # one hand-off's
MODES: tuple[Mode, ...] = ("auto", "frames", "cuda-ipc")


class KvTransportError(ValueError):
    """A --kv-transfer this worker cannot serve; the text says why."""


class KvTransport:
    def __init__(self, mode: Mode, kv_on_cuda: bool) -> None:
        if mode == "cuda-ipc" and not kv_on_cuda:
            raise KvTransportError("--kv-transfer cuda-ipc: this worker's KV cache is not on a CUDA device; "
                                   "use frames or auto")  # fmt: skip
        self.mode = mode
        self.kv_on_cuda = kv_on_cuda
        self._refused: set[str] = set()  # decode endpoints that could not open a handle of ours

    def choose(self, address: str) -> Transport:
        """The transport for a hand-off to the decode worker at `address`."""
        if self.mode == "frames" or not self.kv_on_cuda:
            return "frames"
        if self.mode == "cuda-ipc":
            return "cuda_ipc"
        return "cuda_ipc" if address not in self._refused and on_this_host(address) else "frames"

    def refused(self, address: str) -> None:
        """The decode worker at `address` could not open a handle."""
        self._refused.add(address)


def on_this_host(address: str) -> bool:
    """Whether a ZeroMQ endpoint is on this host: ipc:// and inproc://, or tcp:// to a
    loopback address or to this host's name (what a worker bound to 0.0.0.0 registers)."""
    parts = urlsplit(address)
    if parts.scheme in ("ipc", "inproc"):
        return True
    host = parts.hostname or ""
    return host in ("localhost", "::1", socket.gethostname(), socket.getfqdn()) or host.startswith("127.")
