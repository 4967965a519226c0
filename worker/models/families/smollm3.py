"""SmolLM3: Llama's layer, with some layers attending without RoPE (NoPE): by default
every `no_rope_layer_interval`-th, or as `no_rope_layers` lists them (1: rotates, 0: not).
Where a window is enabled, it is the NoPE layers that slide."""

from __future__ import annotations

from worker.models.config import ModelConfig
from worker.models.families.base import ConfigReader, Family, sliding_fields
from worker.models.families.llama import swiglu_fields

# transformers' SmolLM3Config.default_theta, for a config that names no base.
_DEFAULT_ROPE_THETA = 2000000.0


def read(r: ConfigReader) -> ModelConfig:
    fields = swiglu_fields(r, tie_default=True)
    params = r.cfg.get("rope_parameters")
    if r.cfg.get("rope_theta") is None and not (isinstance(params, dict) and "rope_theta" in params):
        fields["rope_theta"] = _DEFAULT_ROPE_THETA
    num_layers = fields["num_layers"]
    interval = int(r.get("no_rope_layer_interval", 4))
    rotates = r.get("no_rope_layers", [int((i + 1) % interval != 0) for i in range(num_layers)])
    no_rope = tuple(i for i, flag in enumerate(rotates) if not flag)
    default_types = ["sliding_attention" if i in no_rope else "full_attention" for i in range(num_layers)]
    window = sliding_fields(r, num_layers, bool(r.get("use_sliding_window", False)), default_types)
    return ModelConfig(**fields, attention_bias=bool(r.get("attention_bias", False)), no_rope_layers=no_rope, **window)


FAMILY = Family("smollm3", read)
