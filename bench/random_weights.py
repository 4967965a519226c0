"""Random weights for the model shapes (bench/model_shapes.py), made on the device: the whole
model at once as our backend wants it, or one tensor at a time as a rank cuts its shard."""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from worker.models.config import ModelConfig


def random_weights(cfg: Any, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fused projections as our backend wants them; transformers gets views into them."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device, dtype=dtype, generator=gen) * 0.02).contiguous()

    h, d = cfg.hidden_size, cfg.head_dim
    w = {
        "model.embed_tokens.weight": rand(cfg.vocab_size, h),
        "model.norm.weight": torch.ones(h, device=device, dtype=dtype),
        "lm_head.weight": rand(cfg.vocab_size, h),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        w[p + "self_attn.qkv_proj.weight"] = rand((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, cfg.num_heads * d)
        w[p + "mlp.gate_up_proj.weight"] = rand(2 * cfg.intermediate_size, h)
        w[p + "mlp.down_proj.weight"] = rand(h, cfg.intermediate_size)
    return w


class RandomTensors(Mapping[str, torch.Tensor]):
    """Every tensor of the model under its Hugging Face name, made on access (N(0, 0.02),
    seeded by its name, so every rank makes the same one and keeps its own slice)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        from worker.models.loaded_model import expected_shapes

        self.shapes = expected_shapes(cfg)
        self.device, self.dtype = device, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        gen = torch.Generator(device=self.device).manual_seed(zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device, dtype=self.dtype)
        return torch.randn(shape, device=self.device, dtype=self.dtype, generator=gen) * 0.02

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)
