"""What a model family states, and the readers its modules share.

A family reads its config.json into a ModelConfig (the shape and the layer variant),
lists the tensors its checkpoints hold, and names the ones it knowingly drops. Loading
is strict: a config setting no reader took, or a tensor neither listed nor dropped,
fails the load naming it, so a setting that would change the computation is never
silently ignored.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.models.config import CheckpointError, ModelConfig
from worker.models.moe_checkpoint import expert_shapes

# config.json fields that never change the computation: bookkeeping, training-time
# settings, and the generic fields transformers writes for every model.
GENERIC_FIELDS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "initializer_range", "attention_dropout", "pad_token_id", "chunk_size_feed_forward",
    "id2label", "label2id", "is_encoder_decoder", "output_attentions", "output_hidden_states",
    "problem_type", "return_dict", "tokenizer_class", "auto_map", "attn_implementation",
    "_attn_implementation_autoset", "cache_implementation",
    # read by worker/models/quantized_checkpoint.py
    "quantization_config",
})  # fmt: skip

# Tensors some checkpoints carry that the computation never reads (RoPE tables are made here).
GENERIC_IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


class ConfigReader:
    """config.json's fields, each marked as it is read; `unread` names the rest."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.model_type = str(cfg.get("model_type"))
        self.read: set[str] = set(GENERIC_FIELDS)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.cfg.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        if self.cfg.get(key) is None:
            raise CheckpointError(f"config.json: required field {key!r} is missing")
        return self.get(key)

    def ignore(self, *keys: str) -> None:
        """Fields of this family that do not change the computation."""
        self.read.update(keys)

    def only(self, key: str, *allowed: Any) -> None:
        """Refuse a setting other than the ones this decoder computes."""
        value = self.get(key)
        if key in self.cfg and value is not None and value not in allowed:
            raise CheckpointError(
                f"config.json: {key} {value!r} is not supported for model_type {self.model_type!r} "
                f"(supported: {', '.join(repr(a) for a in allowed)})"
            )

    def check_all_read(self) -> None:
        unread = sorted(set(self.cfg) - self.read)
        if unread:
            raise CheckpointError(
                f"config.json: setting {unread[0]!r} is not understood for model_type {self.model_type!r} "
                "(it may change the computation; the loader refuses what it does not read)"
            )


@dataclass(frozen=True, slots=True)
class Family:
    model_type: str
    # config.json -> the model's shape and layer variant
    read: Callable[[ConfigReader], ModelConfig]
    # The checkpoint holds q/k/v as one qkv_proj and gate/up as one gate_up_proj (Phi-3).
    fused_projections: bool = False
    # Regexes of tensors its checkpoints may carry that the computation does not use.
    ignored_tensors: tuple[str, ...] = ()

    def config(self, cfg: dict[str, Any]) -> ModelConfig:
        reader = ConfigReader(cfg)
        config = self.read(reader)
        reader.check_all_read()
        return config

    def tensors(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor of the family's checkpoint, with its shape; Hugging Face's names."""
        return checkpoint_tensors(config, self.fused_projections)

    def ignores(self, name: str, config: ModelConfig) -> bool:
        if config.tie_word_embeddings and name == "lm_head.weight":
            return True  # a copy of the embedding some tied checkpoints store anyway
        return any(re.fullmatch(p, name) for p in GENERIC_IGNORED + self.ignored_tensors)


def checkpoint_tensors(config: ModelConfig, fused: bool = False) -> dict[str, tuple[int, ...]]:
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if config.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for norm in norms:
            shapes[p + norm + ".weight"] = (h,)
        if fused:
            shapes[p + "self_attn.qkv_proj.weight"] = (q_out + 2 * kv_out, h)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.attention_sinks:
            shapes[p + "self_attn.sinks"] = (config.num_heads,)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if i in config.moe_layers:
            shapes |= expert_shapes(config, i)
            continue
        if fused:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, h)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    return shapes


# -- readers the families share ------------------------------------------------------------


def decoder_fields(r: ConfigReader, tie_default: bool = False) -> dict[str, Any]:
    """The fields every decoder here has: its shape, norms' eps, token ids."""
    num_heads = int(r.need("num_attention_heads"))
    hidden = int(r.need("hidden_size"))
    eos = r.get("eos_token_id")
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    bos = r.get("bos_token_id")
    return {
        "model_type": r.model_type,
        "vocab_size": int(r.need("vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(r.need("intermediate_size")),
        "num_layers": int(r.need("num_hidden_layers")),
        "num_heads": num_heads,
        "num_kv_heads": int(r.get("num_key_value_heads", num_heads)),
        "head_dim": int(r.get("head_dim", hidden // num_heads)),
        "rms_norm_eps": float(r.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(r.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": bool(r.get("tie_word_embeddings", tie_default)),
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_ids": eos_ids,
    }


def rope_fields(r: ConfigReader, params: Any = None) -> dict[str, Any]:
    """rope_theta and rope_scaling, from the fields of transformers 4 (rope_theta,
    rope_scaling) or 5 (rope_parameters); `params` overrides rope_parameters (a
    per-layer-type entry). A partial rotary dimension is refused."""
    scaling = r.get("rope_scaling")
    theta = r.get("rope_theta")
    params = r.get("rope_parameters") if params is None else params
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
        partial = params.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise CheckpointError(f"config.json: partial_rotary_factor={partial!r} is not supported (only 1.0)")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return {"rope_theta": float(theta if theta is not None else 10000.0), "rope_scaling": scaling}


def sliding_fields(
    r: ConfigReader, num_layers: int, enabled: bool = True, default_types: list[str] | None = None
) -> dict[str, Any]:
    """The window and the layers it applies to: `layer_types` when given, else
    `default_types`, else every layer."""
    window = r.get("sliding_window")
    layer_types = r.get("layer_types", default_types)
    if window is None or not enabled:
        return {"sliding_window": None, "sliding_layers": ()}
    if layer_types is not None:
        layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    else:
        layers = tuple(range(num_layers))
    if not layers:
        return {"sliding_window": None, "sliding_layers": ()}
    return {"sliding_window": int(window), "sliding_layers": layers}
