"""The capabilities the Llama family has, on the new families: a LoRA adapter made by
peft on Qwen3, Gemma 2 and 3, SmolLM3, Phi-3 (on its fused projections) and Qwen3-MoE (not on its
experts, which are refused) gives peft's logits on both CPU backends, and FP8 / INT4 quantization on
load computes alike on both (the reference the CUDA kernels are held to)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.worker.backends.paged_batches import PagedSequences
from tests.worker.peft_adapters import make_adapter, peft_model
from worker.backends.numpy_backend import NumpyBackend
from worker.backends.torch_backend import TorchBackend
from worker.models.config import CheckpointError
from worker.models.loader import load_model
from worker.models.lora import load_lora_adapter

LOGITS_ATOL = 1e-4
PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 11, 60, 61, 62]


def _backends(directory: Path, quantization: str | None = None) -> list[Any]:
    loaded = load_model(directory, quantization=quantization)
    return [NumpyBackend(loaded), TorchBackend(loaded, device="cpu", max_model_len=64)]


def _prefill(backend: Any, lora_slot: int | None = None) -> np.ndarray:
    backend.allocate_kv_cache(num_blocks=16, block_size=4)
    batch = PagedSequences(num_blocks=16, block_size=4, seed=1).step([("s", PROMPT, 0, len(PROMPT))])
    if lora_slot is not None:
        batch = replace(batch, lora_slots=np.full(len(PROMPT), lora_slot, dtype=np.int64))
    return np.asarray(backend.logits_to_host(backend.forward(batch)))


SPLIT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# peft's target modules per family: Phi-3's checkpoints hold qkv and gate_up fused.
LORA_TARGETS = {"qwen3_head_dim": SPLIT_TARGETS, "gemma2_capped": SPLIT_TARGETS,
                "gemma3_local_global": SPLIT_TARGETS, "smollm3_nope_window": SPLIT_TARGETS,
                "phi3_window": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                "qwen3_moe_top4_dense_layer": ["q_proj", "k_proj", "v_proj", "o_proj"]}  # fmt: skip


@pytest.mark.parametrize("name", list(LORA_TARGETS))
def test_peft_lora_matches_peft(name: str, family_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import torch

    checkpoint = family_checkpoints[name]
    adapter_dir = make_adapter(checkpoint, tmp_path / f"{name}_lora", 4, LORA_TARGETS[name], seed=7)
    with torch.no_grad():
        want = peft_model(checkpoint, adapter_dir)(torch.tensor([PROMPT])).logits[0].numpy()
        base = peft_model(checkpoint, None)(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(want - base).max() > 100 * LOGITS_ATOL  # the adapter matters
    for backend in _backends(checkpoint):
        adapter = load_lora_adapter(adapter_dir, backend.config, max_rank=8)
        backend.enable_lora(num_slots=2, max_rank=8)
        backend.load_lora_slot(1, adapter)
        got = _prefill(backend, lora_slot=1)
        diff = float(np.abs(got - want).max())
        assert diff < LOGITS_ATOL, f"{backend.name}: max |diff| {diff:.2e}"


def test_lora_on_experts_is_refused(family_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    checkpoint = family_checkpoints["qwen3_moe_top4_dense_layer"]
    adapter_dir = make_adapter(checkpoint, tmp_path / "lora", 4, ["q_proj"], seed=7)
    file = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(str(file))
    expert = "base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_A.weight"
    tensors[expert] = np.zeros((4, 32), np.float32)
    save_file(tensors, str(file))
    config = load_model(checkpoint).config
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(expert)} adapts the experts"):
        load_lora_adapter(adapter_dir, config, max_rank=8)


@pytest.mark.parametrize("name", ["qwen3_head_dim", "gemma2_capped", "gemma3_local_global", "phi3_window",
                                  "smollm3_nope_window"])
def test_both_cpu_backends_quantize_on_load_alike(name: str, family_checkpoints: dict[str, Path]) -> None:
    directory = family_checkpoints[name]
    float_logits = _prefill(_backends(directory)[0])
    for mode in ("fp8", "int4"):
        numpy_logits, torch_logits = (_prefill(b) for b in _backends(directory, mode))
        np.testing.assert_allclose(numpy_logits, torch_logits, rtol=1e-4, atol=1e-4, err_msg=mode)
        assert not np.allclose(float_logits, numpy_logits, atol=1e-4), f"{mode} changed nothing"
