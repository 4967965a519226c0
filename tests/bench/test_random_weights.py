"""The bench's random weights hold every tensor transformers' model of the shape has (q/k
norms, Gemma's sandwich norms; no head where it is tied), fused or one at a time; gpt-oss's
experts made packed are MXFP4 values: E2M1 codes times their blocks' scales."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.model_shapes import SHAPES, hf_config
from bench.random_weights import MXFP4_SCALES, RandomTensors, fused_shapes, random_weights
from worker.models import mxfp4
from worker.models.config import ModelConfig


def transformers_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del shapes["lm_head.weight"]  # the embedding, under a second name
    return shapes


# transformers 5 holds a mixture's experts stacked in memory and writes them one by one (the
# hub's layout, which the family lists and its parity tests load): only the dense shapes'
# state dicts name what a checkpoint holds.
DENSE = [name for name, hf in SHAPES.items() if hf["model_type"] not in ("qwen3_moe", "gpt_oss")]


@pytest.mark.parametrize("shape", DENSE)
def test_random_tensors_are_transformers_tensors(shape: str) -> None:
    hf = SHAPES[shape]
    tensors = RandomTensors(ModelConfig.from_hf(hf), torch.device("meta"), torch.bfloat16)
    assert dict(tensors.shapes) == transformers_shapes(hf)


@pytest.mark.parametrize("shape", ["tiny", "qwen3-8b-tiny", "gemma3-12b-tiny"])
def test_fused_random_weights_split_into_transformers_tensors(shape: str) -> None:
    cfg = ModelConfig.from_hf(hf_config(shape))
    weights = random_weights(cfg, torch.device("cpu"), torch.float32)
    assert {k: tuple(v.shape) for k, v in weights.items()} == fused_shapes(cfg)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    split: dict[str, tuple[int, ...]] = {}
    for name, w in weights.items():
        if name.endswith("qkv_proj.weight"):
            for part, rows in zip("qkv", w.split([q, kv, kv]), strict=True):
                split[name.replace("qkv_proj", f"{part}_proj")] = tuple(rows.shape)
        elif name.endswith("gate_up_proj.weight"):
            for part, rows in zip(("gate", "up"), w.chunk(2), strict=True):
                split[name.replace("gate_up_proj", f"{part}_proj")] = tuple(rows.shape)
        else:
            split[name] = tuple(w.shape)
    assert split == transformers_shapes(hf_config(shape))
    # identity norms: Gemma scales by 1 + weight
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.full_like(norm, 0.0 if cfg.norm_offset else 1.0))


def test_packed_random_experts_are_e2m1_codes_times_their_block_scales() -> None:
    cfg = ModelConfig.from_hf(hf_config("gpt-oss-20b-tiny"))
    tensors = RandomTensors(cfg, torch.device("cpu"), torch.bfloat16, expert_dtype="mxfp4")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    packed = tensors[name]
    assert isinstance(packed, mxfp4.Mxfp4Tensor)
    experts, hidden, two_i = tensors.shapes[name]  # the float layout; packed rows first
    assert packed.blocks.dtype == packed.scales.dtype == torch.uint8
    assert tuple(packed.blocks.shape) == (experts, two_i, hidden // 32, 16)
    assert tuple(packed.scales.shape) == (experts, two_i, hidden // 32)
    scales = packed.scales.numpy().astype(np.int32)
    assert set(np.unique(scales)) == set(range(MXFP4_SCALES[0], MXFP4_SCALES[1] + 1))
    values = np.stack(list(packed))  # each expert dequantized: [experts, 2I, hidden] float32
    codes = values / np.ldexp(1.0, scales - 127).repeat(32, axis=-1)
    assert np.isin(codes, mxfp4.E2M1).all()
    # every code drawn about equally often (65,536 values: 4,096 each expected)
    nibbles = packed.blocks.numpy()
    counts = np.bincount(np.concatenate([(nibbles & 15).ravel(), (nibbles >> 4).ravel()]), minlength=16)
    assert counts.min() > 0.9 * counts.mean() and counts.max() < 1.1 * counts.mean()
    # spread like the bf16 shapes' N(0, 0.02): RMS 2.93 x 2 ** -6.6
    assert 0.02 < float(np.sqrt(np.mean(values**2))) < 0.04
    bias = tensors["model.layers.1.mlp.experts.gate_up_proj_bias"]
    assert isinstance(bias, torch.Tensor) and bias.dtype == torch.bfloat16  # biases stay float
