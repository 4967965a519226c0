"""Deterministic mode: a request's logits, and so its seeded samples, do not depend on
the requests batched with it — on each CPU backend, through the executor."""

from __future__ import annotations

import dataclasses
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

from tests.worker.backends.paged_batches import PagedSequences
from tests.worker.executor.helpers import final_tokens, run_all
from worker.backends.base import Backend
from worker.executor import (
    CapacitySchedulerPolicy,
    Executor,
    ExecutorConfig,
    KvCacheConfig,
    Request,
    SamplingConfig,
    SchedulerConfig,
)
from worker.models.loaded_model import LoadedModel
from worker.models.loader import load_model

BACKENDS = ["numpy", pytest.param("torch", marks=pytest.mark.skipif(find_spec("torch") is None,
                                                                    reason="torch is not installed"))]


def make_backend(kind: str, model: LoadedModel) -> Backend:
    if kind == "numpy":
        from worker.backends.numpy_backend import NumpyBackend

        return NumpyBackend(model, deterministic=True)
    from worker.backends.torch_backend import TorchBackend

    return TorchBackend(model, device="cpu", dtype="float32", deterministic=True)


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, int(rng.integers(2, 40))).tolist() for _ in range(32)]


@pytest.mark.parametrize("kind", BACKENDS)
def test_each_rows_logits_are_bitwise_equal_in_every_batching(kind: str, tiny_llama: Path) -> None:
    """Prefill in groups of 1, 7 and 32 sequences, then two generation steps with all 32
    together and one by one: every logits row bit for bit the same."""
    model = load_model(tiny_llama)
    seqs = {f"s{i}": p for i, p in enumerate(prompts(model.config.vocab_size))}
    names = list(seqs)

    def run(group: int) -> dict[tuple[str, int], np.ndarray]:
        backend = make_backend(kind, model)
        backend.allocate_kv_cache(num_blocks=512, block_size=4)
        paged = PagedSequences(num_blocks=512, block_size=4)
        tokens = {n: list(p) for n, p in seqs.items()}
        out: dict[tuple[str, int], np.ndarray] = {}
        for step in range(3):
            size = group if step == 0 else (32 if group == 1 else 1)  # generation: the other way round
            for i in range(0, len(names), size):
                part_names = names[i : i + size]
                part = [(n, tokens[n], 0, len(tokens[n])) if step == 0 else (n, tokens[n], len(tokens[n]) - 1, 1)
                        for n in part_names]  # fmt: skip
                logits = backend.logits_to_host(backend.forward(paged.step(part, all_logits=False)))
                for row, n in enumerate(part_names):
                    out[(n, step)] = logits[row].copy()
            for n in names:
                tokens[n].append(int(out[(n, step)].argmax()))
        return out

    one, seven, whole = run(1), run(7), run(32)
    for key, want in one.items():
        assert np.array_equal(seven[key], want), f"{key}: batched by 7 differs from alone"
        assert np.array_equal(whole[key], want), f"{key}: batched by 32 differs from alone"


def seeded_requests(vocab: int) -> list[Request]:
    return [Request(input_token_ids=p, max_tokens=12, end_id=-1,
                    sampling_config=SamplingConfig(temperature=1.0, top_p=0.9, seed=100 + i))
            for i, p in enumerate(prompts(vocab))]  # fmt: skip


def tokens_in_batches(checkpoint: Path, config: ExecutorConfig, size: int) -> list[list[int]]:
    """The 32 seeded requests, `size` at a time, each group run to completion."""
    requests = seeded_requests(load_model(checkpoint).config.vocab_size)
    out: list[list[int]] = []
    with Executor.from_model(checkpoint, config) as ex:
        for i in range(0, len(requests), size):
            out += [final_tokens(r) for r in run_all(ex, requests[i : i + size]).values()]
    return out


@pytest.mark.parametrize("kind", BACKENDS)
def test_seeded_requests_sample_the_same_tokens_whatever_the_batch(kind: str, tiny_llama: Path) -> None:
    config = ExecutorConfig(backend=kind, device="cpu" if kind == "torch" else None, dtype="float32",
                            deterministic=True, kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=4096))
    together = tokens_in_batches(tiny_llama, config, 32)
    assert all(len(t) == 12 for t in together)
    assert tokens_in_batches(tiny_llama, config, 16) == together
    assert tokens_in_batches(tiny_llama, config, 1) == together
    # 16 tokens a step: prompts cut into chunks, decode tokens sharing steps with chunks.
    assert tokens_in_batches(tiny_llama, dataclasses.replace(config, max_num_tokens=16), 32) == together


@pytest.mark.parametrize("kind", BACKENDS)
def test_seeded_requests_sample_the_same_tokens_after_preemption(kind: str, tiny_llama: Path) -> None:
    roomy = ExecutorConfig(backend=kind, device="cpu" if kind == "torch" else None, dtype="float32",
                           deterministic=True, kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=4096))
    assert_same_tokens_after_preemption(tiny_llama, roomy)


def assert_same_tokens_after_preemption(checkpoint: Path, roomy: ExecutorConfig) -> None:
    """A cache too small for all 32 forces preemption by recompute: the recomputed
    requests rejoin other batches, and still draw the same tokens as one by one."""
    tight = dataclasses.replace(roomy, scheduler_config=SchedulerConfig(CapacitySchedulerPolicy.MAX_UTILIZATION),
                                kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=320,
                                                              enable_block_reuse=False))  # fmt: skip
    want = tokens_in_batches(checkpoint, roomy, 1)
    requests = seeded_requests(load_model(checkpoint).config.vocab_size)
    with Executor.from_model(checkpoint, tight) as ex:
        got = [final_tokens(r) for r in run_all(ex, requests).values()]
        preemptions = ex.core.scheduler.num_preemptions
    assert preemptions > 0, "the tight cache never forced a preemption"
    assert got == want


def test_deterministic_mode_refuses_quantized_weights(tiny_llama: Path) -> None:
    from worker.backends.torch_backend import TorchBackend

    with pytest.raises(ValueError, match="deterministic mode runs float weights only, not fp8"):
        TorchBackend(load_model(tiny_llama), device="cpu", dtype="float32", quantization="fp8", deterministic=True)
