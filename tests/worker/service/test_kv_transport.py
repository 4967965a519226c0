"""How a prefill worker sends KV blocks (worker/service/kv_transport.py): frames
wherever the KV cache is not on CUDA, CUDA IPC under auto only toward a decode worker
on this host that has not refused a handle, and cuda-ipc refused by name on a worker
that cannot share device buffers."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from worker.executor import EngineCore, ExecutorConfig, KvCacheConfig
from worker.service.engine_kv import cuda_devices
from worker.service.kv_transport import KvTransport, KvTransportError, on_this_host

LOCAL = "tcp://127.0.0.1:5700"


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_auto_picks_frames_for_a_kv_cache_off_cuda(tiny_llama: Path, backend: str) -> None:
    if backend == "torch":
        pytest.importorskip("torch")
    config = ExecutorConfig(backend=backend, device="cpu" if backend == "torch" else None,
                            kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=64))  # fmt: skip
    devices = cuda_devices(EngineCore.from_model(tiny_llama, config))
    assert devices == ()
    transport = KvTransport("auto", kv_on_cuda=bool(devices))
    assert transport.choose(LOCAL) == "frames"
    assert transport.choose("ipc:///tmp/decode.kv") == "frames"


def test_auto_picks_cuda_ipc_toward_this_host_until_a_worker_refuses_it() -> None:
    transport = KvTransport("auto", kv_on_cuda=True)
    here = f"tcp://{socket.gethostname()}:5700"
    assert transport.choose(LOCAL) == "cuda_ipc"
    assert transport.choose(here) == "cuda_ipc"
    assert transport.choose("tcp://10.255.1.2:5700") == "frames"  # another host
    transport.refused(LOCAL)
    assert transport.choose(LOCAL) == "frames"
    assert transport.choose(here) == "cuda_ipc"


def test_forced_choices() -> None:
    assert KvTransport("frames", kv_on_cuda=True).choose(LOCAL) == "frames"
    forced = KvTransport("cuda-ipc", kv_on_cuda=True)
    forced.refused(LOCAL)
    assert forced.choose(LOCAL) == "cuda_ipc"  # tried each time; a refusal falls back per transfer
    assert forced.choose("tcp://10.255.1.2:5700") == "cuda_ipc"
    with pytest.raises(KvTransportError, match="--kv-transfer cuda-ipc: this worker's KV cache is not on a CUDA"):
        KvTransport("cuda-ipc", kv_on_cuda=False)


def test_which_endpoints_are_on_this_host() -> None:
    assert on_this_host("ipc:///run/tokenwire/kv") and on_this_host("tcp://localhost:1") and on_this_host(LOCAL)
    assert on_this_host(f"tcp://{socket.gethostname()}:1")
    assert not on_this_host("tcp://gpu-node-7.invalid:1") and not on_this_host("tcp://10.0.0.9:1")
