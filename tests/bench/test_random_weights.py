"""The bench's random weights hold every tensor transformers' model of the shape has (q/k
norms, Gemma's sandwich norms; no head where it is tied), fused or one at a time."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.model_shapes import SHAPES, hf_config
from bench.random_weights import RandomTensors, fused_shapes, random_weights
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
