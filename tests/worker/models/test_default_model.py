"""The embedded default model: converted once into the cache, found by name."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.worker.backends.paged_batches import PagedSequences
from worker.backends.numpy_backend import NumpyBackend
from worker.models.config import CheckpointError
from worker.models.default_model import (
    DEFAULT_MODEL_NAME,
    GGUF_NAME,
    ensure_default_model,
    models_dir,
    resolve_model,
)
from worker.models.loader import load_model


def test_cache_location_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert models_dir() == tmp_path / "tokenwire" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert models_dir() == Path.home() / ".cache" / "tokenwire" / "models"


def test_conversion_into_a_fresh_cache(default_gguf: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "tokenwire" / "models"
    cache.mkdir(parents=True)
    os.symlink(default_gguf, cache / GGUF_NAME)  # no second download
    # a leftover from an interrupted run must not be taken for the model
    (cache / f".{DEFAULT_MODEL_NAME}-leftover").mkdir()

    directory = ensure_default_model()
    assert directory == cache / DEFAULT_MODEL_NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (directory / name).exists(), name
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp  # not converted twice
    assert resolve_model(DEFAULT_MODEL_NAME) == directory

    converted, original = load_model(directory), load_model(default_gguf)
    assert converted.config == original.config
    assert converted.chat_template == original.chat_template
    np.testing.assert_array_equal(
        converted.weights["model.layers.3.self_attn.k_proj.weight"],
        original.weights["model.layers.3.self_attn.k_proj.weight"],
    )
    text = "<|im_start|>user\nBonjour, ça va?<|im_end|>\n"
    assert converted.tokenizer.encode(text).ids == original.tokenizer.encode(text).ids


def test_resolve_paths_and_unknown_names(tiny_llama: Path) -> None:
    assert resolve_model(tiny_llama) == tiny_llama
    assert resolve_model(str(tiny_llama)) == tiny_llama
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        resolve_model("no-such-model-anywhere")


def test_converted_dir_loads_in_transformers(default_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = load_model(default_model_dir)
    ids = model.tokenizer.encode("Hello, my name is").ids
    hf: Any = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    backend = NumpyBackend(model)
    backend.allocate_kv_cache(num_blocks=8, block_size=4)
    got = backend.forward(PagedSequences(num_blocks=8, block_size=4).step([("s", ids, 0, len(ids))]))
    assert float(np.abs(got - want).max()) < 2e-3
