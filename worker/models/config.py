"""The shape of a decoder and its layer variant, read from a Hugging Face config.json by
its family (worker/models/families)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    # Local attention: a query sees keys with q_pos - k_pos < sliding_window, in the
    # layers listed (all of them for Mistral; from `layer_types` when given).
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # -- the layer variant: data the one decoder definition (llama.py) reads ---------------
    # The gated MLP's activation: act(gate) * up.
    hidden_act: str = "silu"  # "silu" | "gelu_pytorch_tanh"
    # RMSNorm scales by (norm_offset + weight): 1 for Gemma's norms, stored as offsets from 1.
    norm_offset: float = 0.0
    # RMSNorm over each q and k head before the rotary embedding (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Norms on the attention and MLP outputs too, before they join the residual (Gemma 2/3).
    sandwich_norms: bool = False
    # The token embeddings are multiplied by this (Gemma: sqrt(hidden_size)).
    embed_scale: float = 1.0
    # The softmax scale of attention; None: head_dim ** -0.5.
    attention_scale: float | None = None
    # cap * tanh(x / cap) over attention scores and over the final logits (Gemma 2).
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # The rotary base of the sliding layers, which then use plain RoPE while the others
    # keep rope_theta and rope_scaling (Gemma 3); None: one rotary embedding for all.
    local_rope_theta: float | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read by the family that `model_type` names (worker/models/families)."""
        from worker.models.families import read_config

        return read_config(cfg)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    def layer_rope(self, layer: int) -> int:
        """Which rotary table a layer uses: 0 the model's, 1 the local one."""
        return 1 if self.local_rope_theta is not None and layer in self.sliding_layers else 0
