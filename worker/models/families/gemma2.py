"""Gemma 2: soft-capped attention scores and final logits, local and global layers in
turn, one rotary embedding."""

from __future__ import annotations

from worker.models.config import ModelConfig
from worker.models.families.base import ConfigReader, Family, rope_fields
from worker.models.families.gemma import gemma_fields


def read(r: ConfigReader) -> ModelConfig:
    return ModelConfig(**gemma_fields(r, sliding_every=2), **rope_fields(r))


FAMILY = Family("gemma2", read)
