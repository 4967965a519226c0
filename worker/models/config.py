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
    # Layers whose attention rotates neither q nor k (SmolLM3's NoPE layers).
    no_rope_layers: tuple[int, ...] = ()
    # The attention output projection carries a bias too (gpt-oss).
    o_bias: bool = False
    # A learned logit per head that joins each query's softmax denominator and weights no
    # value (gpt-oss's attention sinks).
    attention_sinks: bool = False
    # -- mixture of experts: the layers in moe_layers replace the MLP with experts --------
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # each expert's
    moe_layers: tuple[int, ...] = ()  # the rest keep the dense MLP (Qwen3-MoE's mlp_only_layers)
    # How a token's router logits choose and weigh its experts (worker/models/moe_routing.py):
    # "softmax_topk" (softmax over all experts, the top k, renormalised when norm_topk_prob)
    # or "topk_softmax" (the top k logits, then a softmax over them: gpt-oss).
    router: str = "softmax_topk"
    norm_topk_prob: bool = False
    # The router and the experts' gate_up and down projections carry biases (gpt-oss).
    expert_bias: bool = False
    # The experts' activation: "silu" (act(gate) * up) or "swiglu_clamped" (gpt-oss's:
    # gate clamped above and up both sides at 7, (up + 1) * gate * sigmoid(1.702 * gate)).
    expert_act: str = "silu"
    # How the checkpoint names and lays out an MoE layer's tensors
    # (worker/models/moe_checkpoint.py): "mixtral" | "qwen" | "gpt_oss".
    moe_checkpoint: str = ""

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read by the family that `model_type` names (worker/models/families)."""
        from worker.models.families import read_config

        return read_config(cfg)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    def layer_rope(self, layer: int) -> int:
        """Which rotary table a layer uses (worker/models/rope.py::layer_ropes): 0 the
        model's, 1 the local one, and after those the table of zero angles that a layer
        without RoPE reads."""
        local = self.local_rope_theta is not None
        if layer in self.no_rope_layers:
            return 2 if local else 1
        return 1 if local and layer in self.sliding_layers else 0
