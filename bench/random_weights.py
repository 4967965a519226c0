"""Random weights for the model shapes (bench/model_shapes.py), made on the device: the whole
model at once as our backend wants it, or one tensor at a time as a rank cuts its shard;
gpt-oss's experts in bf16 or packed in MXFP4 as its checkpoints ship them (`random_mxfp4`)."""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from worker.models.config import ModelConfig
from worker.models.mxfp4 import BLOCK, Mxfp4Tensor

# E8M0 scale bytes of the random MXFP4 blocks: 2 ** -8 .. 2 ** -6. Uniform E2M1 codes have an
# RMS of 2.9, so the weights spread about as the bf16 shapes' N(0, 0.02).
MXFP4_SCALES = (119, 121)
_EXPERT_PROJECTIONS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


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


def random_mxfp4(experts: int, rows: int, cols: int, device: torch.device, gen: torch.Generator) -> Mxfp4Tensor:
    """Expert weights [experts, rows, cols] made packed, as a checkpoint holds them: random
    bytes (two uniform E2M1 codes each) and a random scale byte in MXFP4_SCALES per 32."""
    blocks = torch.randint(0, 256, (experts, rows, cols // BLOCK, BLOCK // 2), dtype=torch.uint8, device=device,
                           generator=gen)  # fmt: skip
    low, high = MXFP4_SCALES
    scales = torch.randint(low, high + 1, (experts, rows, cols // BLOCK), dtype=torch.uint8, device=device,
                           generator=gen)  # fmt: skip
    return Mxfp4Tensor(blocks, scales)


class RandomTensors(Mapping[str, torch.Tensor | Mxfp4Tensor]):
    """Every tensor of the model under its Hugging Face name, made on access (N(0, 0.02),
    seeded by its name, so every rank makes the same one and keeps its own slice). With
    `expert_dtype` "mxfp4" gpt-oss's expert projections come packed (random_mxfp4)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, expert_dtype: str = "bf16") -> None:
        from worker.models.loaded_model import expected_shapes

        self.shapes = expected_shapes(cfg)
        self.cfg, self.device, self.dtype, self.expert_dtype = cfg, device, dtype, expert_dtype

    def __getitem__(self, name: str) -> torch.Tensor | Mxfp4Tensor:
        shape = self.shapes[name]
        gen = torch.Generator(device=self.device).manual_seed(zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):
            return _identity_norm(self.cfg, shape, self.device, self.dtype)
        if self.expert_dtype == "mxfp4" and name.endswith(_EXPERT_PROJECTIONS):
            experts, cols, rows = shape  # the float layout [experts, in, out]; packed rows first
            return random_mxfp4(experts, rows, cols, self.device, gen)
        return torch.randn(shape, device=self.device, dtype=self.dtype, generator=gen) * 0.02

    def __contains__(self, name: object) -> bool:
        return name in self.shapes  # without making the tensor, as Mapping's default would

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)
