"""Loading Hugging Face checkpoint directories, and the errors bad ones produce."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.checkpoints import CHAT_TEMPLATE, CHECKPOINTS
from worker.models.config import CheckpointError
from worker.models.hf_checkpoint import save_hf_checkpoint
from worker.models.loaded_model import expected_shapes
from worker.models.loader import load_model


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_weights_equal_transformers_state_dict(name: str, tiny_checkpoints: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoints[name]
    model = load_model(directory)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert set(model.weights) == set(expected_shapes(model.config))
    for key, value in model.weights.items():
        assert value.dtype == np.float32
        # bf16 files too: widening bf16 to float32 is exact, so equality is exact
        np.testing.assert_array_equal(value, state[key], err_msg=key)
    assert model.config.tie_word_embeddings == ("lm_head.weight" not in model.weights)


def test_tokenizer_and_template(tiny_checkpoints: dict[str, Path]) -> None:
    model = load_model(tiny_checkpoints["llama_gqa"])
    text = "Paris is the capital of France. héllo 🙂"
    assert model.tokenizer.decode(model.tokenizer.encode(text).ids) == text
    assert model.chat_template == CHAT_TEMPLATE
    assert model.eos_token_ids == (2,)
    assert model.bos_token_id == 1


def test_locating_without_loading(tiny_checkpoints: dict[str, Path]) -> None:
    model = load_model(tiny_checkpoints["mistral_bf16_sharded"], load_weights=False)
    assert model.weights == {}
    refs = model.tensor_refs
    assert set(refs) == set(expected_shapes(model.config))
    assert {ref.dtype for ref in refs.values()} == {"BF16"}
    assert len({ref.file.name for ref in refs.values()}) == 3  # the shards


def test_saved_checkpoint_round_trips(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    model = load_model(tiny_checkpoints["qwen2_bias"])
    save_hf_checkpoint(model, tmp_path / "copy")
    again = load_model(tmp_path / "copy")
    assert again.config == model.config
    for key, value in model.weights.items():
        np.testing.assert_array_equal(again.weights[key], value)


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory: Path, **changes: object) -> None:
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def test_missing_tensor_is_named(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    directory = _copy(tiny_checkpoints["llama_gqa"], tmp_path)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        load_model(directory)


def test_wrong_shape_is_named(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(tiny_checkpoints["llama_gqa"], tmp_path)
    _edit_config(directory, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(128, 64\)"):
        load_model(directory)


def test_untied_head_missing(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(tiny_checkpoints["llama_gqa"], tmp_path)
    _edit_config(directory, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' is missing"):
        load_model(directory)


def test_unknown_architecture_is_named(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(tiny_checkpoints["llama_gqa"], tmp_path)
    _edit_config(directory, model_type="gpt_neox")
    with pytest.raises(CheckpointError, match="model_type 'gpt_neox' is not supported"):
        load_model(directory)


def test_missing_config_field_is_named(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(tiny_checkpoints["llama_gqa"], tmp_path)
    _edit_config(directory, hidden_size=None)
    with pytest.raises(CheckpointError, match="'hidden_size' is missing"):
        load_model(directory)


def test_unsupported_activation_is_named(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(tiny_checkpoints["llama_gqa"], tmp_path)
    _edit_config(directory, hidden_act="gelu")
    with pytest.raises(CheckpointError, match="hidden_act 'gelu'"):
        load_model(directory)


def test_missing_shard_and_tokenizer(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(tiny_checkpoints["mistral_bf16_sharded"], tmp_path)
    (directory / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors, which is missing"):
        load_model(directory)
    directory = _copy(tiny_checkpoints["llama_gqa"], tmp_path / "other")
    (directory / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is missing"):
        load_model(directory)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_model(tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        load_model(tmp_path / "empty")
