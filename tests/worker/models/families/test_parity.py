"""Every family beyond Llama runs through the one decoder definition and stays
token-identical to transformers on both CPU backends, with chunked prefill, KV blocks
shared by a common prefix, and prompts longer than the sliding windows (6 tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.checkpoints import FAMILY_CHECKPOINTS
from tests.worker.backends.greedy_driver import greedy_run
from tests.worker.backends.paged_batches import PagedSequences
from worker.backends.numpy_backend import NumpyBackend
from worker.backends.torch_backend import TorchBackend
from worker.models.loader import load_model

# float32 throughout, a few layers of width 64: what the summation order alone moves.
LOGITS_ATOL = 1e-4
PROMPTS = {"p": [5, 17, 42, 99, 3, 250, 7, 8, 11], "q": [9, 8, 7], "r": list(range(30, 52))}


def _hf(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    # eager: transformers' SDPA path drops the attention soft-cap (Gemma 2); eager is its reference.
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


def _hf_greedy(hf: Any, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    out = {}
    with torch.no_grad():
        for s, p in prompts.items():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None)
            out[s] = ids[0, len(p) :].tolist()
    return out


def _backends(directory: Path) -> list[Any]:
    loaded = load_model(directory)
    # 64: within Phi-3 LongRoPE's original context, which one rotary table can express.
    return [NumpyBackend(loaded), TorchBackend(loaded, device="cpu", max_model_len=64)]


@pytest.mark.parametrize("name", list(FAMILY_CHECKPOINTS))
def test_greedy_tokens_equal_transformers(name: str, family_checkpoints: dict[str, Path]) -> None:
    directory = family_checkpoints[name]
    want = _hf_greedy(_hf(directory), PROMPTS, 10)
    for backend in _backends(directory):
        backend.allocate_kv_cache(num_blocks=96, block_size=4)
        assert greedy_run(backend, PROMPTS, 10, seed=5) == want, f"{name} on {backend.name}"


@pytest.mark.parametrize("name", list(FAMILY_CHECKPOINTS))
def test_logits_with_shared_prefix_match_transformers(name: str, family_checkpoints: dict[str, Path]) -> None:
    directory = family_checkpoints[name]
    hf = _hf(directory)
    rng = np.random.default_rng(3)
    a = rng.integers(0, 320, 20).tolist()
    b = a[:8] + rng.integers(0, 320, 9).tolist()  # shares a's first two blocks
    with torch.no_grad():
        want = {s: hf(torch.tensor([t])).logits[0].numpy() for s, t in (("a", a), ("b", b))}
    for backend in _backends(directory):
        backend.allocate_kv_cache(num_blocks=64, block_size=4)
        paged = PagedSequences(num_blocks=64, block_size=4, seed=4)
        got_a = [backend.forward(paged.step([("a", a, 0, 11)]))]
        paged.tables["b"] = list(paged.tables["a"][:2])  # prefix reuse: b's first 8 tokens are in the cache
        mixed = backend.logits_to_host(backend.forward(paged.step([("b", b, 8, 9), ("a", a, 11, 9)])))
        got = {"a": np.concatenate([backend.logits_to_host(got_a[0]), mixed[9:]]), "b": mixed[:9]}
        for s, rows in (("a", slice(0, 20)), ("b", slice(8, 17))):
            diff = float(np.abs(got[s] - want[s][rows]).max())
            assert diff < LOGITS_ATOL, f"{name} on {backend.name}: {s} max |diff| {diff:.2e}"


def test_phi3_longrope_past_its_original_context(family_checkpoints: dict[str, Path]) -> None:
    """Past original_max_position_embeddings (64) transformers rotates with the long
    factors; numpy does per sequence. One rotary table cannot, so torch refuses to plan for it."""
    directory = family_checkpoints["phi3_longrope"]
    tokens = np.random.default_rng(5).integers(0, 320, 70).tolist()
    with torch.no_grad():
        want = _hf(directory)(torch.tensor([tokens])).logits[0].numpy()
    loaded = load_model(directory)
    backend = NumpyBackend(loaded)
    backend.allocate_kv_cache(num_blocks=32, block_size=4)
    got = backend.forward(PagedSequences(num_blocks=32, block_size=4, seed=2).step([("a", tokens, 0, 70)]))
    assert float(np.abs(got - want).max()) < LOGITS_ATOL
    with pytest.raises(ValueError, match=r"rope_type 'longrope'.*max_model_len <= 64"):
        TorchBackend(loaded, device="cpu", max_model_len=128)
