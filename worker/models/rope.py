"""Rotary position embedding frequencies, with the scaling types of Hugging Face's
decoders: linear, dynamic (NTK), llama3, yarn and longrope (Phi-3's; "su" before)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from worker.models.config import CheckpointError, ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_type(config: ModelConfig) -> str:
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    kind = "longrope" if kind == "su" else kind
    if kind not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"config.json: rope scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return str(kind)


def _base_inv_freq(base: float, dim: int) -> np.ndarray:
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _need(scaling: dict[str, Any], key: str) -> Any:
    if scaling.get(key) is None:
        raise CheckpointError(f"config.json: rope scaling field {key!r} is missing")
    return scaling[key]


def _llama3(inv_freq: np.ndarray, scaling: dict[str, Any], config: ModelConfig) -> np.ndarray:
    factor = float(_need(scaling, "factor"))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", config.max_position_embeddings))
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    scaled = np.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return np.where(medium, blended, scaled)


def _yarn(config: ModelConfig, dim: int, scaling: dict[str, Any]) -> tuple[np.ndarray, float]:
    base = config.rope_theta
    factor = float(_need(scaling, "factor"))
    old_ctx = float(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1 where a dimension keeps its original frequency
    inv_freq = _base_inv_freq(base, dim)
    mixed = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    return mixed, float(attention_factor)


def _longrope(config: ModelConfig, dim: int, scaling: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, float]:
    """The short and long inverse frequencies and the attention factor, as transformers
    computes them (the factor from the context's growth unless given)."""
    original = float(_need(scaling, "original_max_position_embeddings"))
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = _base_inv_freq(config.rope_theta, dim)
    short, long = (np.asarray(_need(scaling, key), dtype=np.float64) for key in ("short_factor", "long_factor"))
    for key, f in (("short_factor", short), ("long_factor", long)):
        if f.shape != base.shape:
            raise CheckpointError(f"config.json: rope scaling field {key!r} has {f.size} values, expected {base.size}")
    return base / short, base / long, float(attention_factor)


class Rope:
    """cos/sin tables for given positions; `seq_lens` matters only for dynamic NTK."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.kind = rope_type(config)
        self.scaling: dict[str, Any] = dict(config.rope_scaling or {})
        dim = config.head_dim
        inv_freq = _base_inv_freq(config.rope_theta, dim)
        self.attention_factor = 1.0
        if self.kind == "linear":
            inv_freq = inv_freq / float(_need(self.scaling, "factor"))
        elif self.kind == "llama3":
            inv_freq = _llama3(inv_freq, self.scaling, config)
        elif self.kind == "yarn":
            inv_freq, self.attention_factor = _yarn(config, dim, self.scaling)
        elif self.kind == "dynamic":
            _need(self.scaling, "factor")
        self.long_inv_freq: np.ndarray | None = None
        self.original_max = 0
        if self.kind == "longrope":
            inv_freq, long, self.attention_factor = _longrope(config, dim, self.scaling)
            self.long_inv_freq = long.astype(np.float32)
            self.original_max = int(self.scaling["original_max_position_embeddings"])
        self.inv_freq = inv_freq.astype(np.float32)

    @classmethod
    def identity(cls, config: ModelConfig) -> Rope:
        """Zero angles at every position: cos 1 and sin 0, so rotating by it leaves q and k
        exactly as they are. A layer without RoPE reads it through the same rope + cache
        write as the others (one fused kernel on CUDA), so no backend needs a path of its own."""
        rope = cls(replace(config, rope_scaling=None))
        rope.inv_freq = np.zeros_like(rope.inv_freq)
        return rope

    def _dynamic_inv_freq(self, seq_len: int) -> np.ndarray:
        # transformers grows the base once a sequence passes max_position_embeddings;
        # here each token uses the length of its own sequence in this step.
        cfg, dim = self.config, self.config.head_dim
        factor = float(self.scaling["factor"])
        seq_len = max(seq_len, cfg.max_position_embeddings)
        base = cfg.rope_theta * ((factor * seq_len / cfg.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim).astype(np.float32)

    def step_cos_sin(
        self, positions: np.ndarray, query_start: np.ndarray, context_lens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of each token of a packed step (positions [T]; sequence i owns tokens
        query_start[i]:query_start[i + 1] and has context_lens[i] tokens after the step)."""
        seq_lens = None
        if self.kind in ("dynamic", "longrope"):
            seq_lens = np.repeat(context_lens, np.diff(query_start))
        return self.cos_sin(positions, seq_lens)

    def position_table(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of positions 0 .. length - 1, one table for every sequence, for a
        backend that looks them up on its device. Dynamic NTK rescales a sequence by its own
        length once it passes max_position_embeddings, which one table cannot express."""
        if self.kind == "longrope" and length > self.original_max:
            raise ValueError(
                f"rope_type 'longrope' switches to its long factors per sequence past original_max_position_embeddings "
                f"({self.original_max}), which one rotary table cannot express; use max_model_len <= "
                f"{self.original_max}, or the numpy backend"
            )
        limit = self.config.max_position_embeddings
        if self.kind == "dynamic" and length > limit:
            raise ValueError(
                f"rope_type 'dynamic' cannot run past max_position_embeddings ({limit}) from a precomputed "
                f"rotary table; use max_model_len <= {limit}, or the numpy backend"
            )
        return self.cos_sin(np.arange(length))

    def cos_sin(self, positions: np.ndarray, seq_lens: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin, float32 [T, head_dim // 2], already multiplied by the attention factor."""
        pos = positions.astype(np.float32)
        if self.long_inv_freq is not None and seq_lens is not None:
            # transformers picks the long factors while a sequence is past the original context.
            long = (seq_lens > self.original_max)[:, None]
            angles = pos[:, None] * np.where(long, self.long_inv_freq[None, :], self.inv_freq[None, :])
        elif self.kind == "dynamic" and seq_lens is not None and (seq_lens > self.config.max_position_embeddings).any():
            inv = np.stack([self._dynamic_inv_freq(int(n)) for n in seq_lens])
            angles = pos[:, None] * inv
        else:
            angles = pos[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        if self.attention_factor != 1.0:
            cos, sin = cos * np.float32(self.attention_factor), sin * np.float32(self.attention_factor)
        return cos.astype(np.float32), sin.astype(np.float32)


def layer_ropes(config: ModelConfig) -> list[Rope]:
    """The rotary embeddings a model's layers use, indexed by ModelConfig.layer_rope: the
    model's, then plain RoPE at local_rope_theta when its local layers have their own, then
    the identity when some layers have none."""
    ropes = [Rope(config)]
    if config.local_rope_theta is not None:
        ropes.append(Rope(replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)))
    if config.no_rope_layers:
        ropes.append(Rope.identity(config))
    return ropes
