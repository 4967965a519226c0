"""Random weights for the model shapes (bench/model_shapes.py), made on the device: the whole
model at once as our backend wants it, or one tensor at a time as a rank cuts its shard."""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from worker.models.config import ModelConfig


def fused_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The family's tensors (worker/models/families), in its order, with q/k/v and gate/up
    fused where it names them apart, as our backend holds them."""
    from worker.models.loaded_model import expected_shapes

    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in expected_shapes(cfg).items():
        # Attention's and the dense MLP's projections; an expert's stay apart (the loader stacks them).
        match = re.fullmatch(r"(.*\.(?:self_attn|mlp)\.)(?:([qkv])_proj|(gate|up)_proj)\.(weight|bias)", name)
        if match is None:
            shapes[name] = shape
            continue
        prefix, attn, _, kind = match.groups()
        fused = prefix + ("qkv_proj." if attn else "gate_up_proj.") + kind
        held = shapes.get(fused)
        shapes[fused] = shape if held is None else (held[0] + shape[0], *shape[1:])
    return shapes


def random_weights(cfg: Any, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fused projections as our backend wants them; transformers gets views into them.
    Norms are the identity (weight 1, or 0 where the family scales by 1 + weight)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = {}
    for name, shape in fused_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w[name] = _identity_norm(cfg, shape, device, dtype)
        else:
            w[name] = (torch.randn(*shape, device=device, dtype=dtype, generator=gen) * 0.02).contiguous()
    return w


def _identity_norm(cfg: ModelConfig, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    fill = torch.zeros if cfg.norm_offset else torch.ones
    return fill(shape, device=device, dtype=dtype)


class RandomTensors(Mapping[str, torch.Tensor]):
    """Every tensor of the model under its Hugging Face name, made on access (N(0, 0.02),
    seeded by its name, so every rank makes the same one and keeps its own slice)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        from worker.models.loaded_model import expected_shapes

        self.shapes = expected_shapes(cfg)
        self.cfg, self.device, self.dtype = cfg, device, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        gen = torch.Generator(device=self.device).manual_seed(zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):
            return _identity_norm(self.cfg, shape, self.device, self.dtype)
        return torch.randn(shape, device=self.device, dtype=self.dtype, generator=gen) * 0.02

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)
