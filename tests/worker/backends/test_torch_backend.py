"""The torch backend on the CPU (float32, plain torch ops) against transformers and the
numpy backend, on tiny random checkpoints over scattered KV blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import CHECKPOINTS
from tests.worker.backends.greedy_driver import greedy_run
from tests.worker.backends.paged_batches import PagedSequences
from worker.backends.base import SamplingBatch
from worker.backends.numpy_backend import NumpyBackend
from worker.backends.torch_backend import TorchBackend
from worker.backends.torch_decoder_ops import TorchLinear
from worker.models.loader import load_model

# float32 on both sides; the remaining difference is summation order.
LOGITS_ATOL = 1e-4


def hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def cpu_backend(directory: Path, num_blocks: int, block_size: int) -> TorchBackend:
    backend = TorchBackend(load_model(directory), device="cpu")
    backend.allocate_kv_cache(num_blocks=num_blocks, block_size=block_size)
    return backend


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_packed_mixed_batches_match_transformers(name: str, tiny_checkpoints: dict[str, Path]) -> None:
    directory = tiny_checkpoints[name]
    backend = cpu_backend(directory, num_blocks=64, block_size=4)
    assert backend.name == "torch-cpu"
    assert backend.dtype == torch.float32
    rng = np.random.default_rng(1)
    vocab = backend.config.vocab_size
    seqs = {s: rng.integers(0, vocab, n).tolist() for s, n in (("a", 25), ("b", 11), ("c", 20))}
    paged = PagedSequences(num_blocks=64, block_size=4)
    steps = [
        # a's prompt in two chunks (the second attends to its cached prefix); b and c
        # prefill, then decode one token per step, mixed with a's chunk.
        [("a", seqs["a"], 0, 13), ("b", seqs["b"], 0, 9), ("c", seqs["c"], 0, 17)],
        [("b", seqs["b"], 9, 1), ("a", seqs["a"], 13, 10), ("c", seqs["c"], 17, 1)],
        [("a", seqs["a"], 23, 1), ("b", seqs["b"], 10, 1), ("c", seqs["c"], 18, 1)],
        [("c", seqs["c"], 19, 1), ("a", seqs["a"], 24, 1)],
    ]
    model = hf_model(directory)
    with torch.no_grad():
        expected = {s: model(torch.tensor([t])).logits[0].numpy() for s, t in seqs.items()}
    for step in steps:
        logits = backend.logits_to_host(backend.forward(paged.step(step)))
        row = 0
        for seq, _, start, count in step:
            want = expected[seq][start : start + count]
            got = logits[row : row + count]
            diff = float(np.abs(got - want).max())
            assert diff < LOGITS_ATOL, f"{name}: {seq}[{start}:{start + count}] max |diff| {diff:.2e}"
            row += count


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "mistral_bf16_sharded"])
def test_greedy_matches_transformers_and_numpy(name: str, tiny_checkpoints: dict[str, Path]) -> None:
    directory = tiny_checkpoints[name]
    prompts = {"p": [5, 17, 42, 99, 3, 250, 7, 8, 11], "q": [9, 8, 7], "r": list(range(30, 52))}
    model = hf_model(directory)
    want = {}
    with torch.no_grad():
        for s, p in prompts.items():
            out = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None)
            want[s] = out[0, len(p) :].tolist()
    loaded = load_model(directory)
    torch_backend = TorchBackend(loaded, device="cpu")
    torch_backend.allocate_kv_cache(num_blocks=96, block_size=4)
    numpy_backend = NumpyBackend(loaded)
    numpy_backend.allocate_kv_cache(num_blocks=96, block_size=4)
    assert greedy_run(torch_backend, prompts, 12, seed=5) == want
    assert greedy_run(numpy_backend, prompts, 12, seed=5) == want


def test_sampling_matches_numpy_sampler(tiny_checkpoints: dict[str, Path]) -> None:
    from worker.backends.numpy_sampler import sample

    rng = np.random.default_rng(7)
    rows, vocab = 64, 300
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    sampling = SamplingBatch(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7], rows).astype(np.float32),
        top_k=rng.choice([0, 1, 5, 40], rows).astype(np.int64),
        top_p=rng.choice([1.0, 0.9, 0.3], rows).astype(np.float32),
        min_p=rng.choice([0.0, 0.05, 0.3], rows).astype(np.float32),
        uniform=rng.random(rows),
        ban_rows=np.array([0, 0, 5, 9], dtype=np.int64),
        ban_tokens=np.array([int(logits[0].argmax()), 3, 100, 7], dtype=np.int64),
    )
    want = sample(logits, sampling)
    ids, log_probs = torch_sample(logits, sampling)
    np.testing.assert_array_equal(ids, want.token_ids)
    np.testing.assert_allclose(log_probs, want.log_probs, atol=1e-5)
    assert ids[0] != int(logits[0].argmax())  # banned
    # top_k = 1 and temperature 0 are both the argmax
    top1 = [i for i in range(1, rows) if sampling.top_k[i] == 1 and i not in (5, 9)]
    assert all(ids[i] == logits[i].argmax() for i in top1)


def torch_sample(logits: np.ndarray, sampling: SamplingBatch) -> tuple[np.ndarray, np.ndarray]:
    from worker.backends.torch_sampler import sample_tokens

    ids, log_probs = sample_tokens(torch.from_numpy(logits), sampling)
    return ids.numpy(), log_probs.numpy()


def test_copy_blocks_and_memory_figures(tiny_checkpoints: dict[str, Path]) -> None:
    backend = cpu_backend(tiny_checkpoints["llama_gqa"], num_blocks=8, block_size=4)
    for cache in backend.ops.k_cache + backend.ops.v_cache:
        cache[2] = torch.randn(cache[2].shape)
    backend.copy_blocks(np.array([2]), np.array([5]))
    for cache in backend.ops.k_cache + backend.ops.v_cache:
        assert torch.equal(cache[5], cache[2])
    cfg = backend.config
    assert backend.kv_bytes_per_token() == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert backend.free_memory_bytes() > 0


def test_from_checkpoint_reads_safetensors_directly(tiny_checkpoints: dict[str, Path]) -> None:
    directory = tiny_checkpoints["mistral_bf16_sharded"]  # bf16 on disk, several shards
    direct = TorchBackend.from_checkpoint(directory, device="cpu")
    loaded = TorchBackend(load_model(directory), device="cpu")
    for a, b in zip(direct.model.layers, loaded.model.layers, strict=True):
        assert isinstance(a.qkv, TorchLinear) and isinstance(b.qkv, TorchLinear)
        assert isinstance(a.gate_up, TorchLinear) and isinstance(b.gate_up, TorchLinear)
        assert torch.equal(a.qkv.weight, b.qkv.weight)
        assert torch.equal(a.gate_up.weight, b.gate_up.weight)
    assert direct.model.lm_head is not None and loaded.model.lm_head is not None  # the whole model has its head
    assert torch.equal(direct.model.lm_head, loaded.model.lm_head)


def test_missing_tensor_is_named(tiny_checkpoints: dict[str, Path]) -> None:
    loaded = load_model(tiny_checkpoints["llama_gqa"])
    weights = dict(loaded.weights)
    del weights["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        TorchBackend(loaded.config, device="cpu", weights=weights)


def test_launch_reads_placeholders_from_the_previous_step(tiny_checkpoints: dict[str, Path]) -> None:
    """Overlapped steps: ids -(k + 1) in a batch are row k of the previous launch's
    samples, resolved on the device; the tokens equal those of synchronous steps."""
    directory = tiny_checkpoints["llama_gqa"]
    prompts = {"a": [5, 17, 42, 99, 3], "b": [9, 8, 7, 6, 5, 4, 3]}
    want = greedy_run(cpu_backend(directory, 32, 4), prompts, 6, seed=0, num_blocks=32, chunk=100)
    backend = cpu_backend(directory, 32, 4)
    paged = PagedSequences(num_blocks=32, block_size=4, seed=0)
    greedy = SamplingBatch(
        temperature=np.zeros(2, np.float32), top_k=np.zeros(2, np.int64), top_p=np.ones(2, np.float32),
        min_p=np.zeros(2, np.float32), uniform=np.zeros(2), ban_rows=np.zeros(0, np.int64),
        ban_tokens=np.zeros(0, np.int64),
    )  # fmt: skip
    tokens = {s: list(p) for s, p in prompts.items()}
    handle = backend.launch(paged.step([(s, t, 0, len(t)) for s, t in tokens.items()], all_logits=False), greedy)
    got: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(6):
        for row, s in enumerate(tokens):
            tokens[s].append(-(row + 1))  # not known on the host yet
        step = paged.step([(s, t, len(t) - 1, 1) for s, t in tokens.items()], all_logits=False)
        following = backend.launch(step, greedy)
        out = handle.result()
        assert out is not None
        for row, s in enumerate(tokens):
            tokens[s][-1] = int(out.token_ids[row])
            got[s].append(int(out.token_ids[row]))
        handle = following
    assert got == want


def test_dynamic_rope_past_the_trained_length_is_refused(tiny_checkpoints: dict[str, Path]) -> None:
    """Dynamic NTK rescales each sequence by its own length past max_position_embeddings,
    which the device's one rotary table cannot express: refused, not run wrong. Up to that
    length it is the plain rope, so the backend runs it."""
    import dataclasses

    loaded = load_model(tiny_checkpoints["llama_gqa"])
    loaded.config = dataclasses.replace(loaded.config, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    limit = loaded.config.max_position_embeddings
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        TorchBackend(loaded, device="cpu", max_model_len=limit + 1)
    backend = TorchBackend(loaded, device="cpu")
    assert backend.max_model_len == limit
