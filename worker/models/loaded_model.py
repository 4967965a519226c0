"""A model in memory: its shape, its float32 weights under Hugging Face names, its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from worker.models.config import CheckpointError, ModelConfig
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
    # Float weights the backends quantize as they build the model: "fp8" | "int4" | None.
    quantize: str | None = None
    # What the model runs as, for logs and the worker's Ready: the checkpoint's scheme or
    # the on-load mode; None for float weights.
    quantization: str | None = None


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder needs, with its shape; the names are Hugging Face's."""
    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    return shapes


def check_shapes(source: Path, config: ModelConfig, found: dict[str, tuple[int, ...]]) -> None:
    """Raise CheckpointError naming the first tensor that is missing or has the wrong shape."""
    for name, shape in expected_shapes(config).items():
        if name not in found:
            raise CheckpointError(f"{source}: tensor {name!r} is missing")
        if tuple(found[name]) != shape:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(found[name])}, expected {shape} from the config"
            )
