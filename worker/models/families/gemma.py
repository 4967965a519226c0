"""What Gemma 2 and Gemma 3 share: GeGLU (tanh) MLPs, RMSNorm scaling by 1 + weight,
norms before and after attention and the MLP, embeddings scaled by sqrt(hidden), the
softmax scaled by query_pre_attn_scalar, and local (sliding) layers among global ones."""

from __future__ import annotations

import math
from typing import Any

from worker.models.config import CheckpointError
from worker.models.families.base import ConfigReader, decoder_fields, sliding_fields


def gemma_fields(r: ConfigReader, sliding_every: int) -> dict[str, Any]:
    """`sliding_every`: without layer_types, every such layer is global, the rest local."""
    act = r.get("hidden_activation") or r.get("hidden_act")
    if act != "gelu_pytorch_tanh":
        raise CheckpointError(
            f"config.json: hidden_activation {act!r} is not supported for model_type {r.model_type!r} "
            "(supported: 'gelu_pytorch_tanh')"
        )
    r.ignore("hidden_act", "hidden_activation")
    r.only("use_bidirectional_attention", False)
    fields = decoder_fields(r, tie_default=True)
    num_layers = fields["num_layers"]
    # Configs from before `layer_types` give the pattern instead (transformers derives the same).
    pattern = int(r.get("sliding_window_pattern", r.get("_sliding_window_pattern", sliding_every)))
    default_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    r.ignore("sliding_window_size")  # an older name of sliding_window, which is read
    hidden = fields["hidden_size"]
    scalar = r.get("query_pre_attn_scalar", fields["head_dim"])
    attn_cap, final_cap = r.get("attn_logit_softcapping"), r.get("final_logit_softcapping")
    return fields | sliding_fields(r, num_layers, default_types=default_types) | {
        "attention_bias": bool(r.get("attention_bias", False)),
        "hidden_act": "gelu_pytorch_tanh",
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "embed_scale": math.sqrt(hidden),
        "attention_scale": float(scalar) ** -0.5,
        "attn_logit_softcap": None if attn_cap is None else float(attn_cap),
        "final_logit_softcap": None if final_cap is None else float(final_cap),
    }
