"""What each spawned rank of test_sharded_backend.py runs: its part of every tiny
checkpoint (its tensor-parallel shard of its pipeline stage's layers) beside the whole
model (TP=1) in the same process, over the start-up warm-up's steps and the same packed
steps, reporting how far its logits (the last stage's) and its KV shard are from the
whole model's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.worker.backends.paged_batches import PagedSequences
from worker.backends.torch_backend import TorchBackend
from worker.models.loader import load_model
from worker.parallel import layout
from worker.parallel.group import join, leave

BLOCK_SIZE, NUM_BLOCKS = 4, 48


def _steps(vocab: int) -> list[Any]:
    """A chunked prefill beside another sequence's prompt, then mixed steps with
    generation rows: all on scattered blocks."""
    rng = np.random.default_rng(7)
    a, b = rng.integers(0, vocab, 26).tolist(), rng.integers(0, vocab, 13).tolist()  # prompts 23 and 9
    paged = PagedSequences(NUM_BLOCKS, BLOCK_SIZE, seed=3)
    steps = [paged.step([("a", a, 0, 11), ("b", b, 0, 9)]), paged.step([("a", a, 11, 12), ("b", b, 9, 1)])]
    steps += [paged.step([("a", a, 23 + i, 1), ("b", b, 10 + i, 1)]) for i in range(3)]
    return steps


def check(rank: int, tp: int, port: int, checkpoints: list[str], results: Any, pp: int = 1) -> None:
    """Reports {checkpoint: (logits diff, or None off the last stage; KV diff)}."""
    torch.set_num_threads(1)  # the ranks share the host's cores
    world = join(rank, tp, port, "cpu", pp)
    report: dict[str, tuple[float | None, float]] = {}
    for path in checkpoints:
        model = load_model(Path(path))
        whole = TorchBackend(model, "cpu")
        part = TorchBackend(model, world=world)
        for b in (whole, part):
            b.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
            b.warm_up()  # as on CUDA: every rank at once, its dummy K and V equal the whole model's
        last = part.stage is None or part.stage.is_last
        logits_diff = 0.0
        for step in _steps(model.config.vocab_size):
            want, got = whole.forward(step), part.forward(step)
            if last:
                logits_diff = max(logits_diff, float((want - got).abs().max()))
            else:
                assert got.numel() == 0
        kv_diff = _kv_diff(whole, part, model.config, world.tensor.rank, tp)
        report[Path(path).name] = (logits_diff if last else None, kv_diff)
    results.put((rank, report))
    leave()


def _kv_diff(whole: TorchBackend, part: TorchBackend, config: Any, rank: int, size: int) -> float:
    """The rank's KV pool against its heads' slice of the whole model's, every layer of its stage."""
    local = layout.local_config(config, size).num_kv_heads
    first = rank * config.num_kv_heads // size
    layers = range(config.num_layers) if part.stage is None else part.stage.layers
    assert len(part.ops.k_cache) == len(layers)
    diff = 0.0
    for whole_cache, part_cache in ((whole.ops.k_cache, part.ops.k_cache), (whole.ops.v_cache, part.ops.v_cache)):
        for w, s in zip([whole_cache[i] for i in layers], part_cache, strict=True):
            assert s.shape[2] == local
            diff = max(diff, float((w[:, :, first : first + local] - s).abs().max()))
    return diff
