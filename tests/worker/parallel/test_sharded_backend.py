"""Each rank's part of the torch backend (gloo, on the CPU) against the whole model in
the same process: logits within 1e-4 over chunked prefills and generation steps, and
each rank's KV pool equal to its heads' slice of the whole model's (KV heads copied
onto several ranks when there are fewer of them than ranks), for its pipeline stage's
layers (micro-batches of the steps' sequences passed from stage to stage)."""

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


def _run_ranks(tp: int, checkpoints: list[Path], pp: int = 1) -> dict[int, dict[str, tuple[float | None, float]]]:
    ctx = multiprocessing.get_context("spawn")
    results: Any = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=rank_check.check, args=(rank, tp, port, [str(c) for c in checkpoints], results, pp))
        for rank in range(tp * pp)
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
            assert logits_diff is not None and logits_diff < 1e-4, (rank, name, logits_diff)
            assert kv_diff < 1e-5, (rank, name, kv_diff)


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2)])
def test_every_stage_matches_the_whole_models_layers(
    tp: int, pp: int, tiny_checkpoints: dict[str, Path], three_layer_qwen2: Path
) -> None:
    """Rank r holds stage pp - 1 - r // tp: rank 0 the last, whose logits are the model's."""
    names = ["llama_gqa", "qwen2_mqa", "mistral_bf16_sharded"]
    reports = _run_ranks(tp, [*(tiny_checkpoints[n] for n in names), three_layer_qwen2], pp)
    assert sorted(reports) == list(range(tp * pp))
    for rank, report in reports.items():
        for name in [*names, three_layer_qwen2.name]:
            logits_diff, kv_diff = report[name]
            if rank < tp:
                assert logits_diff is not None and logits_diff < 1e-4, (rank, name, logits_diff)
            else:
                assert logits_diff is None, (rank, name)
            assert kv_diff < 1e-5, (rank, name, kv_diff)
