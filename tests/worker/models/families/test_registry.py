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
from worker.models.rope import layer_ropes


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


# The published config.json files of the MoE families (transformers 4 fields), as shipped.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}  # fmt: skip
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip


def test_published_moe_configs_read_as_their_variant() -> None:
    gpt_oss = family_of("gpt_oss").config(GPT_OSS_20B)
    assert (gpt_oss.num_experts, gpt_oss.experts_per_token, gpt_oss.router) == (32, 4, "topk_softmax")
    assert gpt_oss.attention_sinks and gpt_oss.o_bias and gpt_oss.expert_bias
    assert gpt_oss.sliding_window == 128 and gpt_oss.sliding_layers == tuple(range(0, 24, 2))
    assert gpt_oss.rope_scaling is not None and gpt_oss.rope_scaling["rope_type"] == "yarn"
    qwen = family_of("qwen3_moe").config(QWEN3_30B_A3B)
    assert (qwen.num_experts, qwen.experts_per_token, qwen.moe_intermediate_size) == (128, 8, 768)
    assert qwen.norm_topk_prob and qwen.moe_layers == tuple(range(48)) and qwen.qk_norm


def test_unsupported_moe_setting_fails_naming_it() -> None:
    with pytest.raises(CheckpointError, match=r"swiglu_limit 5\.0 is not supported for model_type 'gpt_oss'"):
        family_of("gpt_oss").config({**GPT_OSS_20B, "swiglu_limit": 5.0})
    with pytest.raises(CheckpointError, match=r"setting 'shared_expert_intermediate_size' is not understood"):
        family_of("qwen3_moe").config({**QWEN3_30B_A3B, "shared_expert_intermediate_size": 512})


def test_smollm3_nope_layers_read_the_identity_rotary_table(family_checkpoints: dict[str, Path]) -> None:
    loaded = load_model(family_checkpoints["smollm3_nope_window"])
    layers = NumpyBackend(loaded).model.layers
    assert loaded.config.no_rope_layers == (1, 3)
    assert [layer.rope for layer in layers] == [0, 1, 0, 1]
    assert [layer.window for layer in layers] == [None, 6, None, 6]
    cos, sin = layer_ropes(loaded.config)[1].cos_sin(np.arange(40))
    assert (cos == 1.0).all() and (sin == 0.0).all()


def test_smollm3_without_no_rope_layers_takes_every_interval_th(
    family_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """transformers derives no_rope_layers from no_rope_layer_interval when a config lacks it."""
    source = family_checkpoints["smollm3_nope_window"]
    directory = _copy(source, tmp_path, no_rope_layer_interval=4, use_sliding_window=False)
    cfg = json.loads((directory / "config.json").read_text())
    del cfg["no_rope_layers"], cfg["layer_types"]
    (directory / "config.json").write_text(json.dumps(cfg))
    config = load_model(directory).config
    assert config.no_rope_layers == (3,)
    assert config.sliding_window is None
