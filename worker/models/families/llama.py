"""Llama, Mistral and Qwen2: pre-norm decoders with SwiGLU and RoPE; Qwen2 adds q/k/v
biases, Mistral a sliding window (Mistral-NeMo a head_dim other than hidden / heads)."""

from __future__ import annotations

from typing import Any

from worker.models.config import ModelConfig
from worker.models.families.base import ConfigReader, Family, decoder_fields, rope_fields, sliding_fields


def swiglu_fields(r: ConfigReader, tie_default: bool = False) -> dict[str, Any]:
    r.only("hidden_act", "silu")
    r.only("mlp_bias", False)
    # transformers splits the projections by pretraining_tp only to mimic training; same sums.
    r.ignore("pretraining_tp")
    return decoder_fields(r, tie_default) | rope_fields(r)


def qwen_window(r: ConfigReader, num_layers: int) -> dict[str, Any]:
    """Qwen configs carry a sliding_window value even when the switch that enables it is
    off; without layer_types the window applies from max_window_layers on."""
    enabled = bool(r.get("use_sliding_window", False))
    window = sliding_fields(r, num_layers, enabled)
    max_window_layers = int(r.get("max_window_layers", num_layers))
    if enabled and r.cfg.get("layer_types") is None and window["sliding_window"] is not None:
        window["sliding_layers"] = tuple(range(max_window_layers, num_layers))
    return window


def read_llama(r: ConfigReader) -> ModelConfig:
    fields = swiglu_fields(r)
    window = sliding_fields(r, fields["num_layers"])
    return ModelConfig(**fields, attention_bias=bool(r.get("attention_bias", False)), **window)


def read_qwen2(r: ConfigReader) -> ModelConfig:
    fields = swiglu_fields(r)
    window = qwen_window(r, fields["num_layers"])
    return ModelConfig(**fields, attention_bias=bool(r.get("attention_bias", True)), **window)


LLAMA = Family("llama", read_llama)
MISTRAL = Family("mistral", read_llama)
QWEN2 = Family("qwen2", read_qwen2)
