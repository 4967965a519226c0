"""The model shapes the GPU benches build with random weights, as their Hugging Face
configs: Llama-3.1-8B and -70B, Qwen3-8B, Gemma-3-12B (text), and the mixtures of experts
Qwen3-30B-A3B, gpt-oss-20b and gpt-oss-120b (their experts in MXFP4 as shipped, or bf16:
`expert_dtype`), and a tiny one of each architecture for smoke runs (Llama's two shapes
share one, and so do gpt-oss's)."""

from __future__ import annotations

from typing import Any

LLAMA_8B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": None,
}
TINY = {**LLAMA_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096, "bos_token_id": 1,
        "rope_scaling": {**LLAMA_8B["rope_scaling"], "original_max_position_embeddings": 1024}}  # fmt: skip

LLAMA_70B: dict[str, Any] = {
    **LLAMA_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}

# Qwen3-8B's config.json in transformers 5's fields: an RMSNorm over each q and k head.
QWEN3_8B: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "attention_bias": False,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
TINY_QWEN3 = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
              "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip

# Gemma-3-12B's text model: five sliding-window layers (1024 tokens, RoPE base 10^4) to one
# global (base 10^6, linear scaling by 8), GeGLU (tanh), q/k norms, tied embeddings.
GEMMA3_12B: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 262208,
    "hidden_size": 3840,
    "intermediate_size": 15360,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    },
    "query_pre_attn_scalar": 256,
    "sliding_window": 1024,
    "_sliding_window_pattern": 6,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "pad_token_id": 0,
}
# Six layers (five local, one global) and a window shorter than the smoke workloads' sequences.
TINY_GEMMA3 = {**GEMMA3_12B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 6,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 32,
               "sliding_window": 16, "max_position_embeddings": 4096}  # fmt: skip

# Qwen3-30B-A3B's published config.json: 128 experts of width 768, 8 a token, on every layer.
QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
TINY_QWEN3_MOE = {**QWEN3_30B_A3B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                  "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
                  "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip

# gpt-oss-20b's published config.json: 32 experts of width 2880, 4 a token; attention sinks
# and biases; sliding-window (128) and global layers alternating; YaRN.
GPT_OSS_20B: dict[str, Any] = {
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "attention_bias": True,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "initial_context_length": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
}  # fmt: skip
TINY_GPT_OSS = {**GPT_OSS_20B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 64,
                "num_local_experts": 8, "num_experts_per_tok": 2, "experts_per_token": 2, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"] * 2, "max_position_embeddings": 4096,
                "eos_token_id": 2, "pad_token_id": 0}  # fmt: skip

# gpt-oss-120b's published config.json: gpt-oss-20b's with 36 layers of 128 experts.
GPT_OSS_120B: dict[str, Any] = {
    **GPT_OSS_20B,
    "num_local_experts": 128,
    "num_hidden_layers": 36,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}

SHAPES = {"8b": LLAMA_8B, "70b": LLAMA_70B, "qwen3-8b": QWEN3_8B, "gemma3-12b": GEMMA3_12B,
          "qwen3-30b-a3b": QWEN3_30B_A3B, "gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B}  # fmt: skip
TINY_SHAPES = {"tiny": TINY, "qwen3-8b-tiny": TINY_QWEN3, "gemma3-12b-tiny": TINY_GEMMA3,
               "qwen3-30b-a3b-tiny": TINY_QWEN3_MOE, "gpt-oss-20b-tiny": TINY_GPT_OSS,
               "gpt-oss-120b-tiny": TINY_GPT_OSS}  # fmt: skip
EXPERT_DTYPES = ("bf16", "mxfp4")


def shape_name(model_shape: str, tiny: bool) -> str:
    """The name a run goes by (and is saved under): the shape, or its tiny variant."""
    if not tiny:
        return model_shape
    return "tiny" if SHAPES[model_shape]["model_type"] == "llama" else f"{model_shape}-tiny"


def hf_config(name: str) -> dict[str, Any]:
    """The Hugging Face config of a shape or tiny variant, by the name shape_name gives."""
    return {**SHAPES, **TINY_SHAPES}[name]


def expert_dtype(model_shape: str, asked: str | None) -> str:
    """The experts' format a run builds: `asked`, else the checkpoint's (gpt-oss ships MXFP4,
    which only its layout holds: one tensor per projection of all experts)."""
    gpt_oss = SHAPES[model_shape]["model_type"] == "gpt_oss"
    if asked == "mxfp4" and not gpt_oss:
        raise ValueError(f"--expert-dtype mxfp4: the {model_shape} shape's experts are bf16 (MXFP4 is gpt-oss's)")
    return asked or ("mxfp4" if gpt_oss else "bf16")
