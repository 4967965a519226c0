"""The one decoder definition: both backends run `llama.forward` with their own ops and
weights, and stay token-identical to transformers; the weights are built once, fused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.worker.backends.greedy_driver import greedy_run
from tests.worker.backends.paged_batches import PagedSequences
from worker.backends.numpy_backend import NumpyBackend
from worker.backends.torch_backend import TorchBackend
from worker.models import llama
from worker.models.config import CheckpointError
from worker.models.loader import load_model


def hf_greedy(directory: Path, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    out = {}
    with torch.no_grad():
        for s, p in prompts.items():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None)
            out[s] = ids[0, len(p) :].tolist()
    return out


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "mistral_bf16_sharded"])
def test_both_backends_run_the_one_definition(
    name: str, tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tiny_checkpoints[name]
    prompts = {"p": [5, 17, 42, 99, 3, 250, 7, 8, 11], "q": [9, 8, 7], "r": list(range(30, 52))}
    want = hf_greedy(directory, prompts, 10)
    calls: list[tuple[Any, Any, Any]] = []
    recipe = llama.forward

    def spy(model: Any, ops: Any, step: Any, link: Any = None) -> Any:
        logits = recipe(model, ops, step, link)
        calls.append((model, ops, logits))
        return logits

    monkeypatch.setattr(llama, "forward", spy)
    loaded = load_model(directory)
    backends: list[Any] = [NumpyBackend(loaded), TorchBackend(loaded, device="cpu")]
    for backend in backends:
        backend.allocate_kv_cache(num_blocks=96, block_size=4)
        calls.clear()
        assert greedy_run(backend, prompts, 10, seed=5) == want, backend.name
        assert calls, f"{backend.name} never ran llama.forward"
        assert all(model is backend.model and ops is backend.ops for model, ops, _ in calls)
        # What forward returns is the recipe's output, not a second computation.
        batch = PagedSequences(num_blocks=96, block_size=4, seed=6).step([("s", [1, 2, 3], 0, 3)], all_logits=False)
        assert backend.forward(batch) is calls[-1][2]
    numpy_backend, torch_backend = backends
    assert type(numpy_backend.ops) is not type(torch_backend.ops)


def test_weights_are_fused_once(tiny_checkpoints: dict[str, Path]) -> None:
    loaded = load_model(tiny_checkpoints["qwen2_bias"])
    w, cfg = loaded.weights, loaded.config
    model = NumpyBackend(loaded).model
    layer = model.layers[1]
    qkv = np.concatenate([w[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    np.testing.assert_array_equal(layer.qkv.weight, qkv.T)  # stored [in, out] for x @ W
    bias = np.concatenate([w[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv"])
    assert layer.qkv.bias is not None
    np.testing.assert_array_equal(layer.qkv.bias, bias)
    gate_up = np.concatenate([w["model.layers.1.mlp.gate_proj.weight"], w["model.layers.1.mlp.up_proj.weight"]])
    assert layer.gate_up is not None  # a dense layer
    np.testing.assert_array_equal(layer.gate_up.weight, gate_up.T)
    assert layer.o.bias is None and layer.gate_up.bias is None
    assert not cfg.tie_word_embeddings
    np.testing.assert_array_equal(model.lm_head, w["lm_head.weight"].T)


def test_tied_head_is_the_embedding(tiny_checkpoints: dict[str, Path]) -> None:
    loaded = load_model(tiny_checkpoints["llama_gqa"])
    assert loaded.config.tie_word_embeddings
    numpy_model = NumpyBackend(loaded).model
    assert np.shares_memory(numpy_model.lm_head, numpy_model.embed)  # a transposed view, no copy
    torch_model = TorchBackend(loaded, device="cpu").model
    assert torch_model.lm_head is torch_model.embed


def test_sliding_window_per_layer(tiny_checkpoints: dict[str, Path]) -> None:
    loaded = load_model(tiny_checkpoints["mistral_bf16_sharded"])
    assert [layer.window for layer in NumpyBackend(loaded).model.layers] == [12, 12]
    full = load_model(tiny_checkpoints["llama_gqa"])
    assert [layer.window for layer in NumpyBackend(full).model.layers] == [None, None]


def test_missing_tensor_is_named(tiny_checkpoints: dict[str, Path]) -> None:
    loaded = load_model(tiny_checkpoints["qwen2_bias"])
    weights = dict(loaded.weights)
    del weights["model.layers.0.self_attn.k_proj.bias"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias"):
        llama.build_weights(loaded.config, weights, NumpyBackend(loaded).ops)
