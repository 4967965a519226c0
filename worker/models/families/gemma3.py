"""Gemma 3 text (Gemma3ForCausalLM): five local layers to one global, q/k norms, no
soft-capping; the local layers rotate with their own base (plain RoPE), the global
ones with rope_theta and its scaling."""

from __future__ import annotations

from typing import Any

from worker.models.config import CheckpointError, ModelConfig
from worker.models.families.base import ConfigReader, Family, rope_fields
from worker.models.families.gemma import gemma_fields


def _ropes(r: ConfigReader) -> dict[str, Any]:
    params = r.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5: per layer type
        local = params.get("sliding_attention", {})
        if local.get("rope_type", "default") != "default":
            raise CheckpointError(
                f"config.json: rope_type {local.get('rope_type')!r} for sliding_attention layers is not supported "
                "(supported: 'default')"
            )
        local_theta = float(local.get("rope_theta", 10000.0))
        return rope_fields(r, params["full_attention"]) | {"local_rope_theta": local_theta}
    return rope_fields(r) | {"local_rope_theta": float(r.get("rope_local_base_freq", 10000.0))}


def read(r: ConfigReader) -> ModelConfig:
    return ModelConfig(**gemma_fields(r, sliding_every=6), **_ropes(r), qk_norm=True)


FAMILY = Family("gemma3_text", read)
