"""The model families tokenwire loads: one module each, stating how its config.json
reads into a ModelConfig (shape and layer variant) and which tensors its checkpoints
hold. The decoder (worker/models/llama.py) is one definition that reads that data;
adding a family is a module here and its entry below."""

from __future__ import annotations

from typing import Any

from worker.models.config import CheckpointError, ModelConfig
from worker.models.families import gemma2, gemma3, llama, moe, phi3, qwen3, smollm3
from worker.models.families.base import Family

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (llama.LLAMA, llama.MISTRAL, llama.QWEN2, qwen3.FAMILY, gemma2.FAMILY, gemma3.FAMILY, phi3.FAMILY,
              smollm3.FAMILY, moe.MIXTRAL, moe.QWEN3_MOE, moe.GPT_OSS)
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_of(model_type: Any) -> Family:
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise CheckpointError(
            f"config.json: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return family


def read_config(cfg: dict[str, Any]) -> ModelConfig:
    """The family named by `model_type` reads the rest; an unknown family fails first."""
    return family_of(cfg.get("model_type")).config(cfg)


__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "Family", "family_of", "read_config"]
