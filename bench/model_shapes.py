"""The model shapes the GPU benches build with random weights: Llama-3.1-8B and -70B as
their Hugging Face configs, and a tiny one of the same architecture for smoke runs."""

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
SHAPES = {"8b": LLAMA_8B, "70b": LLAMA_70B}
