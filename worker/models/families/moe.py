"""Mixture-of-experts families: Mixtral and Qwen3-MoE (softmax routing over SwiGLU
experts, every layer or Qwen3-MoE's chosen ones), and gpt-oss (router with a bias, top-k
then softmax; clamped SwiGLU experts with biases; attention sinks, q/k/v/o biases, local
and global layers in turn, YaRN)."""

from __future__ import annotations

from worker.models.config import ModelConfig
from worker.models.families.base import ConfigReader, Family, decoder_fields, rope_fields, sliding_fields
from worker.models.families.llama import qwen_window, swiglu_fields


def _training_only(r: ConfigReader) -> None:
    r.ignore("output_router_logits", "router_aux_loss_coef", "router_jitter_noise")


def read_mixtral(r: ConfigReader) -> ModelConfig:
    _training_only(r)
    fields = swiglu_fields(r)
    num_layers = fields["num_layers"]
    return ModelConfig(
        **fields, attention_bias=False, **sliding_fields(r, num_layers),
        num_experts=int(r.need("num_local_experts")), experts_per_token=int(r.need("num_experts_per_tok")),
        moe_intermediate_size=fields["intermediate_size"], moe_layers=tuple(range(num_layers)),
        router="softmax_topk", norm_topk_prob=True, moe_checkpoint="mixtral",
    )  # fmt: skip


def read_qwen3_moe(r: ConfigReader) -> ModelConfig:
    _training_only(r)
    fields = swiglu_fields(r)
    num_layers = fields["num_layers"]
    # transformers 5 writes num_local_experts; the published checkpoints num_experts.
    num_experts = int(r.get("num_experts", r.get("num_local_experts", 0)))
    sparse_step = int(r.get("decoder_sparse_step", 1))
    dense = set(r.get("mlp_only_layers", []))
    moe_layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % sparse_step == 0)
    if num_experts == 0:
        moe_layers = ()
    return ModelConfig(
        **fields, attention_bias=bool(r.get("attention_bias", False)), qk_norm=True,
        **qwen_window(r, num_layers),
        num_experts=num_experts, experts_per_token=int(r.need("num_experts_per_tok")),
        moe_intermediate_size=int(r.need("moe_intermediate_size")), moe_layers=moe_layers,
        router="softmax_topk", norm_topk_prob=bool(r.get("norm_topk_prob", False)), moe_checkpoint="qwen",
    )  # fmt: skip


def read_gpt_oss(r: ConfigReader) -> ModelConfig:
    _training_only(r)
    # The experts' activation is always the clamped SwiGLU; hidden_act names no other.
    r.ignore("hidden_act")
    r.only("swiglu_limit", 7.0)
    # experts_per_token repeats num_experts_per_tok; initial_context_length the rope's
    # original_max_position_embeddings.
    r.ignore("experts_per_token", "initial_context_length")
    fields = decoder_fields(r) | rope_fields(r)
    num_layers = fields["num_layers"]
    bias = bool(r.get("attention_bias", True))
    return ModelConfig(
        **fields, attention_bias=bias, o_bias=bias, attention_sinks=True, **sliding_fields(r, num_layers),
        num_experts=int(r.need("num_local_experts")), experts_per_token=int(r.need("num_experts_per_tok")),
        moe_intermediate_size=fields["intermediate_size"], moe_layers=tuple(range(num_layers)),
        router="topk_softmax", expert_bias=True, expert_act="swiglu_clamped", moe_checkpoint="gpt_oss",
    )  # fmt: skip


MIXTRAL = Family("mixtral", read_mixtral)
QWEN3_MOE = Family("qwen3_moe", read_qwen3_moe)
GPT_OSS = Family("gpt_oss", read_gpt_oss)
