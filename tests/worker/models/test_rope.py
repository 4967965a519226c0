"""RoPE frequencies against transformers' own rope initialisation, per scaling type."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from worker.models.config import CheckpointError, ModelConfig
from worker.models.rope import Rope

SCALINGS: list[dict[str, Any] | None] = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 16,
        "beta_slow": 2,
    },
]


def _configs(scaling: dict[str, Any] | None) -> tuple[Any, ModelConfig]:
    from transformers import LlamaConfig

    # the pre-v5 spelling (rope_theta, rope_scaling), which transformers still accepts
    legacy: dict[str, Any] = {"rope_theta": 50000.0, "rope_scaling": scaling}
    hf = LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64, max_position_embeddings=1024, **legacy)
    ours = ModelConfig.from_hf(hf.to_dict())
    return hf, ours


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: "default" if s is None else s["rope_type"])
def test_inverse_frequencies_match_transformers(scaling: dict[str, Any] | None) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf, ours = _configs(scaling)
    rope = Rope(ours)
    kind = "default" if scaling is None else scaling["rope_type"]
    if kind == "default":
        want = 1.0 / (50000.0 ** (np.arange(0, 64, 2) / 64))
        factor = 1.0
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
        want = inv.numpy()
    np.testing.assert_allclose(rope.inv_freq, want, rtol=1e-6)
    assert rope.attention_factor == pytest.approx(factor)
    cos, sin = rope.cos_sin(np.array([0, 7, 900]))
    np.testing.assert_allclose(cos[1], np.cos(7 * want) * factor, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sin[2], np.sin(900 * want) * factor, rtol=1e-3, atol=1e-3)


def test_dynamic_ntk_grows_past_the_trained_length() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf, ours = _configs({"rope_type": "dynamic", "factor": 2.0})
    rope = Rope(ours)
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=3000)
    positions = np.array([5, 2999])
    cos, _ = rope.cos_sin(positions, seq_lens=np.array([3000, 3000]))
    np.testing.assert_allclose(cos[0], np.cos(5 * want.numpy()), rtol=1e-5, atol=1e-6)
    short, _ = rope.cos_sin(positions, seq_lens=np.array([500, 500]))
    np.testing.assert_allclose(short[0], np.cos(5 * rope.inv_freq), rtol=1e-6)


def test_unsupported_rope_type_is_named() -> None:
    _, ours = _configs(None)
    bad = ModelConfig(**{**{f: getattr(ours, f) for f in ours.__slots__}, "rope_scaling": {"rope_type": "mrope"}})
    with pytest.raises(CheckpointError, match="rope scaling type 'mrope' is not supported"):
        Rope(bad)
