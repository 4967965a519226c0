"""Disaggregated serving with real processes (gateway/disagg.py, protocol/kv_transfer.py):
a request prefilled on one worker and decoded on another, its KV blocks moved over
ZeroMQ, streams the tokens one worker gives; a prefill worker killed as it hands off,
and a decode worker killed mid-stream, both end in a completed stream with the same
tokens; a CUDA IPC handle a decode worker cannot open is answered so, and the frames
sent then are taken. Workers run in deterministic mode (docs/deterministic.md)."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

import protocol
from clients.client import Client
from tests.procs import CLIENT_OPTIONS, Stack, free_port, stack
from worker.executor import EngineCore, ExecutorConfig
from worker.executor.kv_export import KvBlocks, layout_of, store_of
from worker.executor.kv_shared import IpcBuffer
from worker.service.__main__ import model_name_of
from worker.service.kv_transfer import cuda_ipc_of, to_frames

PROMPT = [20 + (i * 7) % 300 for i in range(70)]  # two full blocks of 32 tokens, and a tail
METRICS_PORT = free_port()
SAMPLING = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 1.0, "top_p": 0.9, "seed": 8005}}


@pytest.fixture
def split(long_model: Path, redis_url: str, tmp_path: Path) -> Iterator[Stack]:
    """A prefill worker, a decode worker (with /metrics) and a worker doing both, one gateway."""
    with stack(long_model, redis_url, tmp_path, workers=0, gateways=0) as s:
        s.worker("--deterministic", "--role", "prefill")
        s.worker("--deterministic", "--role", "decode", "--kv-bind", f"tcp://127.0.0.1:{free_port()}",
                 "--metrics-port", str(METRICS_PORT))  # fmt: skip
        s.worker("--deterministic")
        s.gateway().wait_workers(3, timeout=60)
        yield s


def metric(name: str) -> float:
    """A sample of the decode worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_prefilled_on_one_worker_and_decoded_on_another_gives_one_workers_tokens(split: Stack) -> None:
    decode = split.workers[1]
    imported = 'tokenwire_worker_kv_transfers_total{direction="in",outcome="ok"}'
    with Client([split.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        for name, opts in SAMPLING.items():
            # Not streamed, a request is not split: one worker runs it whole.
            whole = client.generate(PROMPT, max_tokens=24, ignore_eos=True, timeout=60, **opts)
            before = metric(imported)
            future = client.stream(PROMPT, max_tokens=24, ignore_eos=True, **opts)
            streamed = [t for chunk in future for t in chunk.token_ids]
            got = future.result(timeout=60)
            assert got.token_ids == whole.token_ids, name
            assert streamed == whole.token_ids, f"{name}: the stream's chunks repeat or miss tokens"
            assert got.text == whole.text, name
            assert metric(imported) == before + 1, f"{name}: the decode worker imported no KV blocks"
            assert split.request_stats(future.request_id)["worker"] == decode.worker_id, name
    assert metric('tokenwire_worker_kv_transfer_bytes_total{direction="in"}') > 0


def test_a_prefill_worker_killed_as_it_hands_off_ends_in_a_complete_stream(split: Stack) -> None:
    prefill = split.workers[0]
    with Client([split.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        whole = client.generate(PROMPT, max_tokens=24, ignore_eos=True, timeout=60, temperature=0.0)
        future = client.stream(PROMPT, max_tokens=24, ignore_eos=True, temperature=0.0)
        chunks = iter(future)
        streamed = list(next(chunks).token_ids)  # the first token is out: its blocks and hand-off are in flight
        prefill.kill9()
        streamed += [t for chunk in chunks for t in chunk.token_ids]
        assert future.result(timeout=60).token_ids == whole.token_ids
        assert streamed == whole.token_ids


def test_a_decode_worker_killed_mid_stream_ends_in_a_complete_stream(split: Stack) -> None:
    decode = split.workers[1]
    tokens = 1500  # a stream that runs long enough to be cut
    with Client([split.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        whole = client.generate(PROMPT, max_tokens=tokens, ignore_eos=True, timeout=120, temperature=0.0)
        future = client.stream(PROMPT, max_tokens=tokens, ignore_eos=True, temperature=0.0)
        streamed: list[int] = []
        chunks = iter(future)
        while len(streamed) < 10:  # tokens past the first: the decode worker's
            streamed += next(chunks).token_ids
        decode.kill9()
        killed_at = time.monotonic()
        streamed += [t for chunk in chunks for t in chunk.token_ids]
        assert future.result(timeout=60).token_ids == whole.token_ids
        assert streamed == whole.token_ids
    assert len(streamed) == tokens and time.monotonic() > killed_at
    assert "continued on another worker" in split.gateways[0].log()


def test_a_cuda_ipc_handle_the_decode_worker_cannot_open_is_answered_and_frames_are_taken(
    long_model: Path, redis_url: str, tmp_path: Path
) -> None:
    kv_address = f"tcp://127.0.0.1:{free_port()}"
    with stack(long_model, redis_url, tmp_path, workers=0, gateways=0) as s:
        s.worker("--deterministic", "--role", "decode", "--kv-bind", kv_address, "--metrics-port", str(METRICS_PORT))
        s.gateway().wait_workers(1, timeout=60)
        core = EngineCore.from_model(long_model, ExecutorConfig(backend="numpy", deterministic=True))
        layout = layout_of(core.blocks, store_of(core.backend), model_name_of(long_model), 1)
        kv = KvBlocks(layout, tuple(PROMPT[:64]), bytes(2 * layout.bytes_per_block))
        shared = IpcBuffer(host_id="elsewhere/0", device_uuid="GPU-0", handle=bytes(64), offset=0,
                         size=len(kv.data), ref_counter="/torch_1_1", ref_counter_offset=0,
                         event_handle=bytes(64), event_sync_required=False)  # fmt: skip
        ctx = zmq.Context()
        prefill = ctx.socket(zmq.DEALER)
        prefill.connect(kv_address)
        try:
            prefill.send_multipart(to_frames("t-ipc", kv, cuda_ipc_of(shared)))
            assert prefill.poll(10_000), "no answer to a CUDA IPC handle"
            ack = protocol.decode(prefill.recv())
            assert ack == protocol.KvAck(transfer_id="t-ipc", opened=False)
            assert metric('tokenwire_worker_kv_transfers_total{direction="in",outcome="unopened"}') == 1
            before = metric('tokenwire_worker_kv_transfers_total{direction="in",outcome="ok"}')
            prefill.send_multipart(to_frames("t-ipc", kv))
            deadline = time.monotonic() + 10
            while metric('tokenwire_worker_kv_transfers_total{direction="in",outcome="ok"}') < before + 1:
                assert time.monotonic() < deadline, "the frames sent after the refusal were not imported"
                time.sleep(0.05)
        finally:
            prefill.close(0)
            ctx.term()
    assert "cannot be opened here (no CUDA KV cache); asking for frames" in s.workers[0].log()
