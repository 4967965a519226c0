"""Phi-3: a Llama-style decoder whose checkpoints fuse q/k/v (qkv_proj) and gate/up
(gate_up_proj), with LongRoPE ("longrope", formerly "su") for the long-context models."""

from __future__ import annotations

from worker.models.config import ModelConfig
from worker.models.families.base import ConfigReader, Family, sliding_fields
from worker.models.families.llama import swiglu_fields


def read(r: ConfigReader) -> ModelConfig:
    r.ignore("resid_pdrop", "embd_pdrop")  # dropout: training only
    r.only("attention_bias", False)
    fields = swiglu_fields(r)
    original = r.get("original_max_position_embeddings")
    scaling = fields["rope_scaling"]
    if scaling is not None and original is not None:
        fields["rope_scaling"] = {"original_max_position_embeddings": original, **scaling}
    window = sliding_fields(r, fields["num_layers"])
    return ModelConfig(**fields, attention_bias=False, **window)


FAMILY = Family("phi3", read, fused_projections=True)
