"""The registry of families and strict loading: an unknown family fails first, in one
line that lists the supported ones; a tensor or a config setting the family does not
understand fails the load, naming it; each family's variant arrives as data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from worker.backends.numpy_backend import NumpyBackend
from worker.models.config import CheckpointError
from worker.models.families import SUPPORTED_MODEL_TYPES, family_of
from worker.models.loader import load_model


def _copy(src: Path, tmp_path: Path, **changes: object) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _add_tensor(directory: Path, name: str, value: np.ndarray) -> None:
    from safetensors.numpy import load_file, save_file

    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    tensors[name] = value
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("model_type", ["gpt2", "gemma3", "gemma"])
def test_unsupported_family_is_one_line_naming_it(
    model_type: str, family_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    # A Gemma 2 checkpoint relabelled: its GeGLU activation would fail later; the family fails first.
    directory = _copy(family_checkpoints["gemma2_capped"], tmp_path, model_type=model_type)
    with pytest.raises(CheckpointError) as info:
        load_model(directory)
    message = str(info.value)
    assert "\n" not in message
    assert f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})" in message
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"} <= set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("name", ["qwen3_head_dim", "gemma3_local_global", "phi3_window"])
def test_unknown_tensor_fails_naming_it(name: str, family_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(family_checkpoints[name], tmp_path)
    _add_tensor(directory, "model.layers.1.self_attn.rel_bias.weight", np.zeros(4, np.float32))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.1\.self_attn\.rel_bias\.weight' is not part"):
        load_model(directory)


def test_tied_checkpoint_may_store_its_head(family_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(family_checkpoints["qwen3_tied_window"], tmp_path)
    embed = load_model(directory).weights["model.embed_tokens.weight"]
    _add_tensor(directory, "lm_head.weight", embed)
    assert "lm_head.weight" not in load_model(directory).weights


@pytest.mark.parametrize(
    ("name", "setting", "match"),
    [
        ("qwen3_head_dim", {"logit_scale": 2.0}, "setting 'logit_scale' is not understood for model_type 'qwen3'"),
        ("gemma2_capped", {"alt_attention": True}, "setting 'alt_attention' is not understood"),
        ("phi3_window", {"partial_rotary_factor": 0.75}, "setting 'partial_rotary_factor' is not understood"),
        ("qwen3_head_dim", {"hidden_act": "relu"}, "hidden_act 'relu' is not supported for model_type 'qwen3'"),
        ("gemma3_local_global", {"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
        ("gemma3_local_global", {"use_bidirectional_attention": True}, "use_bidirectional_attention True"),
        ("llama_gqa", {"mlp_bias": True}, "mlp_bias True is not supported"),
    ],
)
def test_unknown_or_unsupported_setting_fails_naming_it(
    name: str, setting: dict[str, object], match: str, family_checkpoints: dict[str, Path],
    tiny_checkpoints: dict[str, Path], tmp_path: Path,
) -> None:  # fmt: skip
    source = {**family_checkpoints, **tiny_checkpoints}[name]
    with pytest.raises(CheckpointError, match=match):
        load_model(_copy(source, tmp_path, **setting))


def test_gemma3_layers_carry_their_window_and_rotary_base(family_checkpoints: dict[str, Path]) -> None:
    loaded = load_model(family_checkpoints["gemma3_local_global"])
    layers = NumpyBackend(loaded).model.layers
    assert [layer.window for layer in layers] == [6, None, 6]
    assert [layer.rope for layer in layers] == [1, 0, 1]
    assert loaded.config.local_rope_theta == 10000.0 and loaded.config.rope_theta == 1000000.0
    assert loaded.config.rope_scaling is not None and loaded.config.rope_scaling["factor"] == 2.0


def test_gemma3_config_of_transformers_4_reads_the_same(family_checkpoints: dict[str, Path]) -> None:
    """Released Gemma 3 configs predate layer_types and per-layer rope_parameters."""
    new = json.loads((family_checkpoints["gemma3_local_global"] / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("layer_types", "rope_parameters", "_sliding_window_pattern")}
    old |= {"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 2,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "num_hidden_layers": 3}  # fmt: skip
    family = family_of("gemma3_text")
    assert family.config(old) == family.config(new)
