"""The shape of a Llama-family decoder, read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Hugging Face `architectures` / `model_type` values this decoder covers.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor or field."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mistral-style local attention: a query sees keys with q_pos - k_pos < sliding_window,
    # in the layers listed (all of them for Mistral; from `layer_types` when given).
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"config.json: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )

        def need(key: str) -> Any:
            if key not in cfg:
                raise CheckpointError(f"config.json: required field {key!r} is missing")
            return cfg[key]

        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers 5 moves rope_theta and scaling into `rope_parameters`.
        params = cfg.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        num_layers = int(need("num_hidden_layers"))
        window, sliding_layers = _sliding_window(cfg, model_type, num_layers)
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
            sliding_layers=sliding_layers,
        )


def _sliding_window(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    window = cfg.get("sliding_window")
    # Qwen2 configs carry a sliding_window value even when the switch that enables it is off.
    if window is None or (model_type == "qwen2" and not cfg.get("use_sliding_window", False)):
        return None, ()
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    elif model_type == "qwen2":
        layers = tuple(range(int(cfg.get("max_window_layers", num_layers)), num_layers))
    else:
        layers = tuple(range(num_layers))
    return (int(window), layers) if layers else (None, ())
