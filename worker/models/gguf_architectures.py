"""What each llama.cpp architecture a GGUF file may name stands for: its Hugging Face
family, its tensors under Hugging Face names, and how its `{arch}.*` metadata reads back
into the config.json that family's reader (worker/models/families) then reads.

The metadata is read strictly: a `{arch}.*` field no reader here took fails the load
naming it, as a config.json field does. llama.cpp's converter leaves some settings out
of the file and hard-codes them in llama.cpp instead; those are restored here as
llama.cpp assumes them (each marked where it is done).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.models.config import CheckpointError

# GGUF layer tensor (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_ATTENTION = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_SWIGLU = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **_ATTENTION,
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    **_SWIGLU,
}
# Gemma's four norms: llama.cpp's "ffn_norm" is the one before the MLP, not after attention.
_GEMMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    **_ATTENTION,
    **_SWIGLU,
}
# Phi-3's fused projections keep their layout: attn_qkv is qkv_proj, ffn_up is gate_up_proj.
_PHI3_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")
# Phi-3's LongRoPE factors: read into the config, not weights.
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


class Metadata:
    """A GGUF file's `{arch}.*` fields, each marked as it is read; `check_all_read` names the rest."""

    def __init__(self, meta: dict[str, Any], arch: str, path: Path) -> None:
        self.meta, self.arch, self.path = meta, arch, path
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        full = f"{self.arch}.{key}"
        self.read.add(full)
        return self.meta.get(full, default)

    def need(self, key: str) -> Any:
        if f"{self.arch}.{key}" not in self.meta:
            raise CheckpointError(f"{self.path}: metadata field {self.arch}.{key!r} is missing")
        return self.get(key)

    def check_all_read(self) -> None:
        unread = sorted(k for k in self.meta if k.startswith(f"{self.arch}.") and k not in self.read)
        if unread:
            raise CheckpointError(
                f"{self.path}: metadata field {unread[0]!r} is not understood for architecture {self.arch!r} "
                "(it may change the computation; the loader refuses what it does not read)"
            )


@dataclass(frozen=True, slots=True)
class FileTensors:
    """What the config reads from the file's tensors rather than its metadata."""

    shapes: dict[str, tuple[int, ...]]  # by GGUF name, slowest dimension first as in numpy
    read: Callable[[str], np.ndarray]  # a tensor by GGUF name, as float32


@dataclass(frozen=True, slots=True)
class Architecture:
    model_type: str
    hf_class: str
    layer_tensors: dict[str, str]
    # The metadata (and tensors) -> config.json fields beyond the shape (given).
    config: Callable[[Metadata, FileTensors, dict[str, Any]], dict[str, Any]]
    # llama.cpp reorders each q/k head's rows to interleaved pairs (Llama's converter).
    permuted_qk: bool = False
    # Norm weights stored as 1 + weight: Gemma's RMSNorm scales by (1 + weight) and
    # llama.cpp's by the weight alone, so its converter folds the 1 in.
    norms_plus_one: bool = False
    # Tensors consumed by `config`.
    config_tensors: tuple[str, ...] = ()

    def hf_tensor_name(self, gguf_name: str) -> str | None:
        """The Hugging Face name of one of this architecture's tensors; None if it is none of them."""
        if gguf_name in _GLOBAL_TENSORS:
            return _GLOBAL_TENSORS[gguf_name]
        match = _LAYER_NAME.fullmatch(gguf_name)
        if match and match.group(2) in self.layer_tensors:
            return f"model.layers.{match.group(1)}.{self.layer_tensors[match.group(2)]}"
        return None


def shape_fields(m: Metadata, tensors: FileTensors) -> dict[str, Any]:
    """The fields every architecture here has: the decoder's shape."""
    heads = int(m.need("attention.head_count"))
    hidden = int(m.need("embedding_length"))
    head_dim = int(m.get("attention.key_length", hidden // heads))
    value_dim = int(m.get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise CheckpointError(
            f"{m.path}: {m.arch}.attention.value_length {value_dim} differs from the key length {head_dim} "
            "(not supported)"
        )
    rotary = int(m.get("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise CheckpointError(
            f"{m.path}: {m.arch}.rope.dimension_count {rotary} is not the head size {head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    return {
        "hidden_size": hidden,
        "intermediate_size": int(m.need("feed_forward_length")),
        "num_hidden_layers": int(m.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(m.need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(m.need("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors.shapes,
    }


def _rope_scaling(m: Metadata) -> dict[str, Any] | None:
    kind = m.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(m.need("rope.scaling.factor"))}
    original = m.get("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _llama(m: Metadata, tensors: FileTensors, shape: dict[str, Any]) -> dict[str, Any]:
    return {
        "rope_theta": float(m.get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(m),
        "attention_bias": "blk.0.attn_q.bias" in tensors.shapes,
        "hidden_act": "silu",
    }


def _query_pre_attn_scalar(shape: dict[str, Any], layers_of_27b: int) -> float:
    """The converter stores no attention scale; llama.cpp takes hidden / heads for the
    27B models (known by their layer count) and head_dim for the rest, as their
    checkpoints' query_pre_attn_scalar says."""
    if shape["num_hidden_layers"] == layers_of_27b:
        return shape["hidden_size"] / shape["num_attention_heads"]
    return float(shape["head_dim"])


def _gemma2(m: Metadata, tensors: FileTensors, shape: dict[str, Any]) -> dict[str, Any]:
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": float(m.get("rope.freq_base", 10000.0)),
        "sliding_window": int(m.need("attention.sliding_window")),
        "attn_logit_softcapping": float(m.need("attn_logit_softcapping")),
        "final_logit_softcapping": float(m.need("final_logit_softcapping")),
        "query_pre_attn_scalar": _query_pre_attn_scalar(shape, layers_of_27b=46),
    }


def _gemma3(m: Metadata, tensors: FileTensors, shape: dict[str, Any]) -> dict[str, Any]:
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": float(m.need("rope.freq_base")),
        "rope_scaling": _rope_scaling(m),
        # llama.cpp rotates the local layers with base 10000 unless the file says otherwise.
        "rope_local_base_freq": float(m.get("rope.freq_base_swa", 10000.0)),
        # Absent or 0 where every layer is global (llama.cpp then slides none).
        "sliding_window": int(m.get("attention.sliding_window", 0)) or None,
        "final_logit_softcapping": m.get("final_logit_softcapping"),
        "query_pre_attn_scalar": _query_pre_attn_scalar(shape, layers_of_27b=62),
    }


def _phi3(m: Metadata, tensors: FileTensors, shape: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {"rope_theta": float(m.get("rope.freq_base", 10000.0)), "hidden_act": "silu"}
    # The converter writes 0 for no window (Phi-4).
    window = int(m.get("attention.sliding_window", 0))
    fields["sliding_window"] = window or None
    original = m.get("rope.scaling.original_context_length")
    if original is not None:
        fields["original_max_position_embeddings"] = int(original)
    present = [name for name in _ROPE_FACTORS if name in tensors.shapes]
    attn_factor = m.get("rope.scaling.attn_factor")
    if not present:
        if attn_factor is not None and float(attn_factor) != 1.0:
            raise CheckpointError(f"{m.path}: {m.arch}.rope.scaling.attn_factor without LongRoPE factors")
        return fields
    if len(present) == 1 or original is None:
        raise CheckpointError(
            f"{m.path}: LongRoPE needs rope_factors_long.weight, rope_factors_short.weight and "
            f"{m.arch}.rope.scaling.original_context_length"
        )
    long, short = (tensors.read(name).astype(np.float64).tolist() for name in _ROPE_FACTORS)
    fields["rope_scaling"] = {"rope_type": "longrope", "long_factor": long, "short_factor": short}
    if attn_factor is not None:
        # The converter's value is the one transformers derives; keep it only where it is not.
        scale = int(m.need("context_length")) / int(original)
        derived = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(int(original)))
        if not math.isclose(float(attn_factor), derived, rel_tol=1e-6):
            fields["rope_scaling"]["attention_factor"] = float(attn_factor)
    return fields


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "LlamaForCausalLM", _LLAMA_LAYER, _llama, permuted_qk=True),  # Mistral too
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", _LLAMA_LAYER, _llama),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", _LLAMA_LAYER | _QK_NORMS, _llama),
    "gemma2": Architecture("gemma2", "Gemma2ForCausalLM", _GEMMA_LAYER, _gemma2, norms_plus_one=True),
    "gemma3": Architecture("gemma3_text", "Gemma3ForCausalLM", _GEMMA_LAYER | _QK_NORMS, _gemma3, norms_plus_one=True),
    "phi3": Architecture("phi3", "Phi3ForCausalLM", _PHI3_LAYER, _phi3, config_tensors=_ROPE_FACTORS),
}


def architecture_of(meta: dict[str, Any], path: Path) -> tuple[str, Architecture]:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: general.architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return arch, ARCHITECTURES[arch]
