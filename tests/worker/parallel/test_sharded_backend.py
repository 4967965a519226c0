"""Each rank's shard of the torch backend (gloo, on the CPU) against the whole model in
the same process: logits within 1e-4 over chunked prefills and generation steps, and
each rank's KV pool equal to its heads' slice of the whole model's (KV heads copied
onto several ranks when there are fewer of them than ranks)."""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.worker.parallel import rank_check

# Every family, and one KV head under 2 and 4 ranks (qwen2_mqa; llama_gqa has 2 under 4).
CHECKPOINTS = ["llama_gqa", "llama_untied_llama3", "llama_linear_mha", "qwen2_bias", "qwen2_mqa",
               "mistral_bf16_sharded"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(size: int, checkpoints: list[Path]) -> dict[int, dict[str, tuple[float, float]]]:
    ctx = multiprocessing.get_context("spawn")
    results: Any = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=rank_check.check, args=(rank, size, port, [str(c) for c in checkpoints], results))
        for rank in range(size)
    ]
    for p in procs:
        p.start()
    try:
        reports = dict(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return reports


@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_rank_matches_the_whole_model(size: int, tiny_checkpoints: dict[str, Path]) -> None:
    reports = _run_ranks(size, [tiny_checkpoints[name] for name in CHECKPOINTS])
    assert sorted(reports) == list(range(size))
    for rank, report in reports.items():
        for name in CHECKPOINTS:
            logits_diff, kv_diff = report[name]
            assert logits_diff < 1e-4, (rank, name, logits_diff)
            assert kv_diff < 1e-5, (rank, name, kv_diff)
