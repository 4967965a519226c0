"""A model in memory: its shape, its float32 weights under Hugging Face names, its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from worker.models.config import CheckpointError, ModelConfig
from worker.models.families import family_of
from worker.models.mxfp4_checkpoint import Mxfp4File
from worker.models.quantization import QuantizedWeight
from worker.models.safetensors_io import TensorRef


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    # float32, Hugging Face names; empty when loaded with load_weights=False.
    weights: dict[str, np.ndarray]
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # config.json as a dict (rebuilt from the metadata for a GGUF file).
    hf_config: dict[str, Any]
    source: Path
    # Where each tensor lives on disk (safetensors checkpoints only), so a torch backend can
    # read bf16 straight to the device instead of going through these float32 copies.
    tensor_refs: dict[str, TensorRef] = field(default_factory=dict)
    # tokenizer_config.json as a dict (special tokens, add_bos_token, ...).
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    # A quantized checkpoint's linear weights under their float names ("...q_proj.weight"),
    # which are then not in `weights` (nor in `tensor_refs`).
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    # gpt-oss's MXFP4 expert projections under their float names ("...mlp.experts.gate_up_proj"),
    # packed and still on disk: read as the model builds each layer (with or without load_weights).
    mxfp4_experts: dict[str, Mxfp4File] = field(default_factory=dict)
    # Float weights the backends quantize as they build the model: "fp8" | "int4" | None.
    quantize: str | None = None
    # What the model runs as, for logs and the worker's Ready: the checkpoint's scheme or
    # the on-load mode; None for float weights.
    quantization: str | None = None


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model's checkpoint, with its shape, as its family names them."""
    return family_of(config.model_type).tensors(config)


def check_shapes(source: Path, config: ModelConfig, found: dict[str, tuple[int, ...]]) -> None:
    """Raise CheckpointError naming the first tensor that is missing or has the wrong shape."""
    for name, shape in expected_shapes(config).items():
        if name not in found:
            raise CheckpointError(f"{source}: tensor {name!r} is missing")
        if tuple(found[name]) != shape:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(found[name])}, expected {shape} from the config"
            )
