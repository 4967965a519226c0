"""KV blocks between two processes on one GPU by CUDA IPC (worker/backends/torch_kv_ipc.py,
worker/service/engine_kv.py), each side in a process of its own (kv_ipc_peer.py): the
handle alone crosses the socket, the decode side continues the greedy run of one core
doing both from the blocks it copied, and the prefill side's buffer is freed once the
decode side answers; a decode side that cannot open the handle gets the same blocks as
frames and continues the same."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.gpu.kv_ipc_peer import MAX_TOKENS, PROMPT, core_of
from tests.gpu.test_kv_export_gpu import tokens_of
from worker.executor import Request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ROOT = Path(__file__).parents[2]


def peer(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.gpu.kv_ipc_peer", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def findings(process: subprocess.Popen[str]) -> dict[str, object]:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    found: dict[str, object] = json.loads(out.splitlines()[-1])
    return found


@pytest.mark.parametrize("decode_side", ["copies", "cannot open"])
def test_kv_blocks_cross_by_cuda_ipc_between_two_processes(tmp_path: Path, decode_side: str) -> None:
    model = make_checkpoint("llama_gqa", tmp_path / "llama")
    whole = Request(PROMPT, MAX_TOKENS, streaming=True, end_id=-1)
    one_core = tokens_of(core_of(str(model)), whole)
    first = tokens_of(core_of(str(model)), dataclasses.replace(whole, max_tokens=1))
    assert first == one_core[:1]

    address = f"ipc://{tmp_path}/kv"
    how = "copy" if decode_side == "copies" else "refuse"
    decode = peer("decode", str(model), address, str(first[0]), how)
    prefill = peer("prefill", str(model), address)
    sent, got = findings(prefill), findings(decode)

    assert got["tokens"] == one_core
    assert sent["frames_sent"] == 1  # the header alone: the blocks stayed on the GPU
    assert sent["shared"] == 1 and sent["shared_after"] == 0
    assert isinstance(sent["freed"], int) and isinstance(sent["num_bytes"], int)
    assert sent["freed"] >= sent["num_bytes"]  # the shared buffer went back to the allocator
    assert got["num_blocks"] == 4 and got["reused"] == 4  # the prompt's blocks were not recomputed
    if decode_side == "copies":
        assert got["ipc"] and got["opened"] and not got["via_frames"], got
        assert sent["opened"] and not sent["resent"]
    else:
        assert got["via_frames"] and not got["ipc"], got
        assert not sent["opened"] and sent["resent"]
