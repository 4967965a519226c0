"""Per-step host timing over a real engine core and torch backend on the CPU: every
step that launched is recorded, its parts add up to no more than the step."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.host_timing import HostTimer, summarize
from tests.checkpoints import make_checkpoint
from worker.backends.torch_backend import TorchBackend
from worker.executor import EngineCore, ExecutorConfig, KvCacheConfig, Request
from worker.models.loader import load_model


def test_every_launched_step_is_timed(tmp_path: Path) -> None:
    backend = TorchBackend(load_model(make_checkpoint("llama_gqa", tmp_path / "m")), device="cpu")
    timer = HostTimer(backend)
    config = ExecutorConfig(backend="torch", max_batch_size=4, kv_cache_config=KvCacheConfig(max_tokens=1024))
    core = EngineCore(backend, config)
    timer.attach(core)
    core.add_requests([(i, Request(input_token_ids=[5, 6, 7, 8 + i], max_tokens=6, end_id=-1)) for i in range(3)])
    turns = 0
    while core.has_work:
        core.step()
        turns += 1
    steps = timer.take()
    assert 6 <= len(steps) <= turns  # one launch per token step (prefill samples the first token)
    for s in steps:
        assert s.prepare >= 0 and s.launch > 0 and s.wait >= 0
        assert s.prepare + s.launch + s.wait <= s.total
    summary = summarize(steps)
    assert summary["host_ms"] + summary["gpu_wait_ms"] == pytest.approx(summary["step_ms"], abs=1e-2)
    assert timer.take() == []
