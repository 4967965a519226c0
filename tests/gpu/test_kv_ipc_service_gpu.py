"""Disaggregated serving on one GPU with real workers (worker/service/kv_sender.py,
worker/service/server.py): a prefill worker under `--kv-transfer cuda-ipc` shares its
blocks to the decode worker, which copies them GPU to GPU and answers, and the stream
gives the tokens of one worker doing the whole request. Needs redis-server beside CUDA."""

from __future__ import annotations

import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from clients.client import Client
from tests.checkpoints import make_checkpoint
from tests.procs import CLIENT_OPTIONS, free_port, stack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]
PROMPT = [20 + (i * 7) % 300 for i in range(70)]  # full blocks and a tail
ON_GPU = ("--backend", "torch", "--device", "cuda", "--kv-tokens", "4096", "--deterministic")


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def transfers(port: int, direction: str, outcome: str) -> float:
    return metric(port, f'tokenwire_worker_kv_transfers_total{{direction="{direction}",outcome="{outcome}"}}')


def test_workers_on_one_gpu_move_kv_blocks_by_cuda_ipc(redis_url: str, tmp_path: Path) -> None:
    model = make_checkpoint("llama_gqa", tmp_path / "tiny-llama")
    prefill_port, decode_port = free_port(), free_port()
    with stack(model, redis_url, tmp_path, workers=0, gateways=0) as s:
        s.worker(*ON_GPU, "--role", "prefill", "--kv-transfer", "cuda-ipc", "--metrics-port", str(prefill_port))
        s.worker(*ON_GPU, "--role", "decode", "--kv-bind", f"tcp://127.0.0.1:{free_port()}",
                 "--metrics-port", str(decode_port))  # fmt: skip
        s.worker(*ON_GPU)
        s.gateway().wait_workers(3, timeout=300)
        with Client([s.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
            whole = client.generate(PROMPT, max_tokens=24, ignore_eos=True, timeout=120, temperature=0.0)
            future = client.stream(PROMPT, max_tokens=24, ignore_eos=True, temperature=0.0)
            streamed = [t for chunk in future for t in chunk.token_ids]
            got = future.result(timeout=120)
        assert got.token_ids == whole.token_ids and streamed == whole.token_ids
        assert s.request_stats(future.request_id)["worker"] == s.workers[1].worker_id
        deadline = time.monotonic() + 10
        while transfers(prefill_port, "out", "acked") < 1:  # the answer frees the shared buffer
            assert time.monotonic() < deadline, "the decode worker's answer did not come back"
            time.sleep(0.05)
        assert transfers(prefill_port, "out", "shared") == 1 and transfers(prefill_port, "out", "ok") == 0
        assert transfers(decode_port, "in", "copied") == 1 and transfers(decode_port, "in", "ok") == 0
        assert transfers(prefill_port, "out", "unopened") == 0
