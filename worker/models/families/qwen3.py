"""Qwen3 dense: Qwen2's layout without the q/k/v biases, with an RMSNorm over each q and
k head before the rotary embedding."""

from __future__ import annotations

from worker.models.config import ModelConfig
from worker.models.families.base import ConfigReader, Family
from worker.models.families.llama import qwen_window, swiglu_fields


def read(r: ConfigReader) -> ModelConfig:
    fields = swiglu_fields(r)
    window = qwen_window(r, fields["num_layers"])
    return ModelConfig(**fields, attention_bias=bool(r.get("attention_bias", False)), qk_norm=True, **window)


FAMILY = Family("qwen3", read)
