"""PEFT LoRA adapters read onto the fused projections: the parts land in their blocks with
the scaling folded in, and every adapter the model cannot run is refused by name."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.worker.peft_adapters import make_adapter
from worker.models.config import CheckpointError, ModelConfig
from worker.models.lora import load_lora_adapter

PREFIX = "base_model.model.model.layers"


def _config(checkpoint: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((checkpoint / "config.json").read_text()))


def test_fused_parts_are_stacked_block_diagonal_with_the_scaling_folded_in(
        tiny_llama: Path, lora_adapters: dict[str, Path]) -> None:
    cfg = _config(tiny_llama)
    raw = load_file(lora_adapters["a"] / "adapter_model.safetensors")
    adapter = load_lora_adapter(lora_adapters["a"], cfg, max_rank=16)
    assert adapter.rank == 4
    assert set(adapter.weights) == {(i, role) for i in range(cfg.num_layers) for role in ("qkv", "down")}
    qkv = adapter.weights[1, "qkv"]
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert qkv.a.shape == (3, 4, cfg.hidden_size) and qkv.b.shape == (q_out + 2 * kv_out, 3, 4)
    scaling = 16 / 4  # lora_alpha / r
    np.testing.assert_array_equal(qkv.a[0], raw[f"{PREFIX}.1.self_attn.q_proj.lora_A.weight"])
    np.testing.assert_array_equal(qkv.a[2], raw[f"{PREFIX}.1.self_attn.v_proj.lora_A.weight"])
    assert not qkv.a[1].any()  # k is not adapted
    np.testing.assert_allclose(qkv.b[:q_out, 0], raw[f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"] * scaling)
    np.testing.assert_allclose(qkv.b[q_out + kv_out :, 2], raw[f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"] * scaling)
    off_block = np.ones(qkv.b.shape, dtype=bool)
    off_block[:q_out, 0] = off_block[q_out + kv_out :, 2] = False
    assert not qkv.b[off_block].any()


def test_rslora_scales_by_alpha_over_the_square_root_of_r(tiny_llama: Path, lora_adapters: dict[str, Path]) -> None:
    raw = load_file(lora_adapters["b"] / "adapter_model.safetensors")
    adapter = load_lora_adapter(lora_adapters["b"], _config(tiny_llama), max_rank=8)
    np.testing.assert_allclose(adapter.weights[0, "o"].b[:, 0],
                               raw[f"{PREFIX}.0.self_attn.o_proj.lora_B.weight"] * (16 / math.sqrt(8)), rtol=1e-6)


def test_rank_above_max_rank_is_refused(tiny_llama: Path, lora_adapters: dict[str, Path]) -> None:
    with pytest.raises(CheckpointError, match="rank 8 is above max_rank 4"):
        load_lora_adapter(lora_adapters["b"], _config(tiny_llama), max_rank=4)


def test_missing_files_are_named(tiny_llama: Path, lora_adapters: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"adapter_config\.json is missing"):
        load_lora_adapter(tmp_path, _config(tiny_llama), max_rank=16)
    shutil.copy(lora_adapters["a"] / "adapter_config.json", tmp_path)
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors is missing"):
        load_lora_adapter(tmp_path, _config(tiny_llama), max_rank=16)


def test_lm_head_and_embedding_targets_are_unsupported(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = tiny_checkpoints["llama_untied_llama3"]  # an lm_head of its own to adapt
    for module in ("lm_head", "embed_tokens"):
        adapter = make_adapter(checkpoint, tmp_path / module, 4, ["q_proj", module], seed=3)
        with pytest.raises(CheckpointError, match=f"unsupported target module '{module}'"):
            load_lora_adapter(adapter, _config(checkpoint), max_rank=16)


def test_an_adapter_of_another_model_is_a_shape_mismatch(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    other = make_adapter(tiny_checkpoints["llama_linear_mha"], tmp_path / "mha", 4, ["q_proj"], seed=4)
    with pytest.raises(CheckpointError, match="shape mismatch with the model"):
        load_lora_adapter(other, _config(tiny_checkpoints["llama_gqa"]), max_rank=16)
