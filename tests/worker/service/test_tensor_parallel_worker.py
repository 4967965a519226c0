"""A tensor- or pipeline-parallel worker (2 ranks, gloo) whose second rank is killed
with kill -9 under a stream: the request ends with an error, the worker exits 1, and
no rank process is left behind. Under pipeline parallelism the second rank is the
first stage, whose hand-offs rank 0 (the last stage) is waiting for."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import protocol
from ops.process import spawned
from tests.procs import Stack, running
from tests.worker.service.test_worker_service import FakeGateway


@pytest.mark.parametrize("split", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_a_killed_rank_ends_the_requests_and_the_worker(
    split: str, long_model: Path, redis_server, tmp_path: Path
) -> None:
    s = Stack(long_model, redis_server.url, tmp_path)
    try:
        w = s.worker("--backend", "torch", "--device", "cpu", split, "2")
        g = FakeGateway(w.endpoint)
        g.send(protocol.Submit(request_id="doomed", input_token_ids=[5, 6], max_tokens=6000, streaming=True,
                               sampling_config=protocol.SamplingConfig(min_tokens=6000)))  # fmt: skip
        g.recv_until(lambda: bool(g.responses("doomed")), timeout=60)
        (engine,) = spawned(w.process.pid)  # rank 0: the engine process, which started rank 1
        (rank1,) = spawned(engine)
        os.kill(rank1, signal.SIGKILL)
        g.recv_until(lambda: bool(g.errors()), timeout=30)
        (error,) = g.errors()
        assert error.request_id == "doomed" and error.code == protocol.ErrorCode.INTERNAL
        assert w.process.wait(timeout=30) == 1
        deadline = time.monotonic() + 10
        while running(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(engine) and not running(rank1)
        assert "model rank tokenwire-rank1 exited" in w.log()
        g.close()
    finally:
        s.close()
