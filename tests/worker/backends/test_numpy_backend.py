"""The numpy backend against transformers (torch CPU, float32) on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.checkpoints import CHECKPOINTS
from tests.worker.backends.paged_batches import PagedSequences
from worker.backends.numpy_backend import NumpyBackend
from worker.models.loader import load_model

# float32 on both sides; the remaining difference is summation order.
LOGITS_ATOL = 1e-4


def hf_logits(directory: Path, tokens: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_packed_mixed_batches_match_transformers(name: str, tiny_checkpoints: dict[str, Path]) -> None:
    directory = tiny_checkpoints[name]
    model = load_model(directory)
    backend = NumpyBackend(model)
    backend.allocate_kv_cache(num_blocks=64, block_size=4)
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    seqs = {"a": rng.integers(0, vocab, 25).tolist(), "b": rng.integers(0, vocab, 11).tolist()}
    seqs["c"] = rng.integers(0, vocab, 20).tolist()
    paged = PagedSequences(num_blocks=64, block_size=4)
    steps = [
        # a's prompt in two chunks; b and c prefill, then generate one token per step
        [("a", seqs["a"], 0, 13), ("b", seqs["b"], 0, 9), ("c", seqs["c"], 0, 17)],
        [("b", seqs["b"], 9, 1), ("a", seqs["a"], 13, 10), ("c", seqs["c"], 17, 1)],
        [("a", seqs["a"], 23, 1), ("b", seqs["b"], 10, 1), ("c", seqs["c"], 18, 1)],
        [("c", seqs["c"], 19, 1), ("a", seqs["a"], 24, 1)],
    ]
    expected = {s: hf_logits(directory, toks) for s, toks in seqs.items()}
    for step in steps:
        logits = backend.forward(paged.step(step))
        row = 0
        for seq, _, start, count in step:
            want = expected[seq][start : start + count]
            got = logits[row : row + count]
            assert got.shape == want.shape
            diff = float(np.abs(got - want).max())
            assert diff < LOGITS_ATOL, f"{name}: {seq}[{start}:{start + count}] max |diff| {diff:.2e}"
            row += count


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "mistral_bf16_sharded"])
def test_greedy_decoding_matches_generate(name: str, tiny_checkpoints: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoints[name]
    prompt = [5, 17, 42, 99, 3, 250, 7, 8, 11]
    hf: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
    want = out[0, len(prompt) :].tolist()

    backend = NumpyBackend(load_model(directory))
    backend.allocate_kv_cache(num_blocks=32, block_size=4)
    paged = PagedSequences(num_blocks=32, block_size=4, seed=3)
    tokens = list(prompt)
    logits = backend.forward(paged.step([("s", tokens, 0, len(tokens))], all_logits=False))
    for _ in range(16):
        tokens.append(int(logits[-1].argmax()))
        logits = backend.forward(paged.step([("s", tokens, len(tokens) - 1, 1)]))
    assert tokens[len(prompt) :] == want


def test_logits_only_for_requested_rows(tiny_checkpoints: dict[str, Path]) -> None:
    model = load_model(tiny_checkpoints["qwen2_bias"])
    parts = [("x", list(range(10)), 0, 10), ("y", list(range(20, 26)), 0, 6)]
    outputs = []
    for all_logits in (True, False):
        backend = NumpyBackend(model)
        backend.allocate_kv_cache(num_blocks=16, block_size=4)
        outputs.append(backend.forward(PagedSequences(num_blocks=16, block_size=4).step(parts, all_logits)))
    every, last = outputs
    assert last.shape == (2, model.config.vocab_size)
    assert last.dtype == np.float32
    np.testing.assert_allclose(last, every[[9, 15]], atol=1e-5)


def test_copy_blocks_copies_every_layer(tiny_checkpoints: dict[str, Path]) -> None:
    backend = NumpyBackend(load_model(tiny_checkpoints["llama_gqa"]))
    backend.allocate_kv_cache(num_blocks=8, block_size=4)
    for cache in backend.ops.k_cache + backend.ops.v_cache:
        cache[2] = np.random.default_rng(0).standard_normal(cache[2].shape)
    backend.copy_blocks(np.array([2]), np.array([5]))
    for cache in backend.ops.k_cache + backend.ops.v_cache:
        np.testing.assert_array_equal(cache[5], cache[2])


def test_memory_figures(tiny_checkpoints: dict[str, Path]) -> None:
    backend = NumpyBackend(load_model(tiny_checkpoints["llama_gqa"]))
    cfg = backend.config
    assert backend.kv_bytes_per_token() == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert backend.free_memory_bytes() > 0


def test_grouping_and_tiling_leave_logits_unchanged(
    tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation tokens of very different context lengths go in separate gather groups,
    and long chunks in query tiles; neither may change a logit."""
    from worker.backends import numpy_attention

    model = load_model(tiny_checkpoints["mistral_bf16_sharded"])
    rng = np.random.default_rng(5)
    lengths = {"s0": 3, "s1": 4, "s2": 30, "s3": 31, "s4": 60, "long": 40}
    seqs = {name: rng.integers(0, 320, n + 1).tolist() for name, n in lengths.items()}
    prefill = [(name, toks, 0, lengths[name]) for name, toks in seqs.items() if name != "long"]
    prefill.append(("long", seqs["long"], 0, 20))
    step = [(name, toks, lengths[name], 1) for name, toks in seqs.items() if name != "long"]
    step.append(("long", seqs["long"], 20, 21))

    def run() -> tuple[list[np.ndarray], int, int]:
        backend = NumpyBackend(model)
        backend.allocate_kv_cache(num_blocks=64, block_size=4)
        paged = PagedSequences(num_blocks=64, block_size=4, seed=9)
        outputs = [backend.forward(paged.step(prefill))]
        batch = paged.step(step)
        attention = backend.step(batch).attention
        outputs.append(backend.forward(batch))
        return outputs, len(attention.groups), len(attention.chunks)

    plain, plain_groups, plain_chunks = run()
    assert (plain_groups, plain_chunks) == (1, 1)
    monkeypatch.setattr(numpy_attention, "GATHER_BUDGET", 64 * 2 * 16)  # 64 keys of 2 heads x 16
    monkeypatch.setattr(numpy_attention, "SCORE_BUDGET", 4 * 41 * 6)  # 6-query tiles
    monkeypatch.setattr(numpy_attention, "_MIN_SPLIT_KEYS", 0)
    split, split_groups, split_chunks = run()
    assert split_groups == 3  # context lengths {4, 5}, {31, 32}, {61}
    assert split_chunks == 4  # 21 queries in tiles of 6
    for a, b in zip(plain, split, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
