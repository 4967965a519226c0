"""GGUF loading on the default model, with transformers loading the same file as the oracle."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.worker.backends.paged_batches import PagedSequences
from worker.backends.numpy_backend import NumpyBackend
from worker.models.config import CheckpointError
from worker.models.gguf_loader import hf_tensor_name, unpermute_rows
from worker.models.loader import load_model

# Both sides dequantize the same Q4_1 blocks to float32; what remains is summation order
# over 30 layers, on logits of magnitude ~30.
LOGITS_ATOL = 2e-3

TEXTS = [
    "The capital of France is",
    "  leading spaces,\ttabs\n\nand blank lines",
    "héllo wörld 🙂 日本語 — ünïcode",
    "<|im_start|>user\nWhat is 12345 * 678?<|im_end|>\n<|im_start|>assistant\n",
    "don't won't it's 3.14159 x==y",
]


def test_unpermute_inverts_llama_cpp_layout() -> None:
    heads, head_dim, cols = 3, 8, 5
    hf = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    half = head_dim // 2
    # llama.cpp: HF row (head, j * half + i) is stored at (head, 2 * i + j)
    stored = np.empty_like(hf)
    for h in range(heads):
        for j in range(2):
            for i in range(half):
                stored[h * head_dim + 2 * i + j] = hf[h * head_dim + j * half + i]
    np.testing.assert_array_equal(unpermute_rows(stored, heads), hf)


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("rope_freqs.weight") is None


@pytest.fixture(scope="module")
def gguf_model(default_gguf: Path) -> Any:
    return load_model(default_gguf)


@pytest.fixture(scope="module")
def hf_tokenizer(default_gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


def test_default_model_config(gguf_model: Any) -> None:
    cfg = gguf_model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings
    assert cfg.rope_theta == 100000.0
    assert gguf_model.eos_token_ids == (2,)
    assert "<|im_start|>" in (gguf_model.chat_template or "")


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(text: str, gguf_model: Any, hf_tokenizer: Any) -> None:
    ids = gguf_model.tokenizer.encode(text).ids
    assert ids == hf_tokenizer(text)["input_ids"]
    assert gguf_model.tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    assert gguf_model.tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(
        ids, skip_special_tokens=True
    )


@pytest.mark.slow  # transformers dequantizes the whole GGUF (~15 s)
def test_logits_match_transformers_gguf(default_gguf: Path, gguf_model: Any, hf_tokenizer: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32)
    ids = hf_tokenizer("The capital of France is Paris, and the capital of Italy is")["input_ids"]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    backend = NumpyBackend(gguf_model)
    backend.allocate_kv_cache(num_blocks=16, block_size=4)
    paged = PagedSequences(num_blocks=16, block_size=4)
    # the prompt in two chunks, the second attending to the first through the cache
    first = backend.forward(paged.step([("p", ids, 0, 6)]))
    second = backend.forward(paged.step([("p", ids, 6, len(ids) - 6)]))
    got = np.concatenate([first, second])
    assert float(np.abs(got - want).max()) < LOGITS_ATOL
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "qwen3_head_dim"])
def test_tiny_gguf_matches_its_checkpoint_and_transformers(
    name: str, tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.checkpoints import make_checkpoint, write_gguf

    checkpoint = tiny_checkpoints.get(name)
    if checkpoint is None:
        # Qwen3 at head_dim 128, not hidden / heads: transformers' GGUF reader takes the
        # head size from Qwen3's default, not from the file (our reader takes key_length).
        checkpoint = make_checkpoint(name, tmp_path / name, head_dim=128)
    path = write_gguf(checkpoint, tmp_path / f"{name}.gguf")
    ours, original = load_model(path), load_model(checkpoint)
    assert ours.config.attention_bias == original.config.attention_bias
    assert ours.config.tie_word_embeddings == original.config.tie_word_embeddings
    for key, value in original.weights.items():
        if key == "model.embed_tokens.weight":  # Q8_0 in the file
            np.testing.assert_allclose(ours.weights[key], value, atol=np.abs(value).max() / 100)
        else:  # float32 in the file: the q/k un-permutation must be exact
            np.testing.assert_array_equal(ours.weights[key], value, err_msg=key)

    text = "<|im_start|>user\nParis is the capital of France.<|im_end|>"
    ids = ours.tokenizer.encode(text).ids
    assert ids == original.tokenizer.encode(text).ids
    hf_tok: Any = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert ids == hf_tok(text)["input_ids"]

    hf: Any = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    backend = NumpyBackend(ours)
    backend.allocate_kv_cache(num_blocks=16, block_size=4)
    got = backend.forward(PagedSequences(num_blocks=16, block_size=4).step([("s", ids, 0, len(ids))]))
    assert float(np.abs(got - want).max()) < 1e-4


# name, config overrides, whether transformers' GGUF reader reads the file fully. Its
# config mapping for gemma2 / gemma3 has no soft-caps, attention scale, local rope base or
# rope scaling, and for phi3 no window or LongRoPE: it falls back to its config defaults,
# so those files are held to their safetensors checkpoint (itself held to transformers by
# tests/worker/models/families/test_parity.py). The Gemma checkpoints take
# query_pre_attn_scalar = head_dim, the scale llama.cpp assumes (the file has none), and
# Gemma 3 six layers, llama.cpp's fixed pattern of five local to one global.
NON_LLAMA_GGUF: dict[str, tuple[str, dict[str, Any], bool]] = {
    "gemma2_capped": ("gemma2_capped", {"query_pre_attn_scalar": 16}, False),
    "gemma3_local_global": (
        "gemma3_local_global",
        {"num_hidden_layers": 6, "layer_types": None, "query_pre_attn_scalar": 24},
        False,
    ),
    "phi3_window": ("phi3_window", {}, False),
    "phi3_longrope": ("phi3_longrope", {}, False),
    "phi3_plain": ("phi3_window", {"sliding_window": None}, True),
}


@pytest.mark.parametrize("case", list(NON_LLAMA_GGUF))
def test_gemma_and_phi3_gguf_match_their_checkpoint(case: str, tmp_path: Path) -> None:
    """A GGUF file of Gemma 2, Gemma 3 or Phi-3, laid out as llama.cpp's converter writes
    it, loads into its checkpoint's config and weights and gives its greedy tokens and
    logits on the numpy backend; where transformers' GGUF reader reads the architecture
    fully (Phi-3 without window or LongRoPE), its logits too."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.checkpoints import make_checkpoint, write_gguf
    from tests.worker.backends.greedy_driver import greedy_run

    name, overrides, against_transformers = NON_LLAMA_GGUF[case]
    checkpoint = make_checkpoint(name, tmp_path / name, **overrides)
    path = write_gguf(checkpoint, tmp_path / f"{case}.gguf", embedding_q8=False)
    ours, original = load_model(path), load_model(checkpoint)
    # The file's special tokens are its tokenizer's (the checkpoint's config names others);
    # its eps and LongRoPE factors are float32.
    unchanged: dict[str, Any] = {"bos_token_id": None, "eos_token_ids": (), "rms_norm_eps": 0.0, "rope_scaling": None}
    assert replace(ours.config, **unchanged) == replace(original.config, **unchanged)
    assert ours.config.rms_norm_eps == pytest.approx(original.config.rms_norm_eps, rel=1e-7)
    scaling, want_scaling = ours.config.rope_scaling or {}, original.config.rope_scaling or {}
    assert scaling.keys() == want_scaling.keys()
    for key, value in want_scaling.items():
        assert scaling[key] == (pytest.approx(value, rel=1e-7) if isinstance(value, list) else value), key
    assert ours.weights.keys() == original.weights.keys()
    for key, value in original.weights.items():  # Gemma's norms round once through 1 + weight
        np.testing.assert_allclose(ours.weights[key], value, rtol=0, atol=2e-7, err_msg=key)

    prompts = {"p": [5, 17, 42, 99, 3, 250, 7, 8, 11], "r": list(range(30, 52))}
    tokens, logits = {}, {}
    for label, model in (("gguf", ours), ("checkpoint", original)):
        backend = NumpyBackend(model)
        backend.allocate_kv_cache(num_blocks=96, block_size=4)
        tokens[label] = greedy_run(backend, prompts, 8, seed=5)
        backend.allocate_kv_cache(num_blocks=32, block_size=4)
        logits[label] = backend.forward(PagedSequences(num_blocks=32, block_size=4).step([("r", prompts["r"], 0, 22)]))
    assert tokens["gguf"] == tokens["checkpoint"]
    # float32 weights that differ only by the norms' rounding, a few layers of width 64.
    assert float(np.abs(logits["gguf"] - logits["checkpoint"]).max()) < 1e-4

    if against_transformers:
        hf: Any = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
        with torch.no_grad():
            want = hf(torch.tensor([prompts["r"]])).logits[0].numpy()
        assert float(np.abs(logits["gguf"] - want).max()) < 1e-4


def test_a_field_or_tensor_the_architecture_lacks_fails_the_load_naming_it(tmp_path: Path) -> None:
    from tests.checkpoints import make_checkpoint, write_gguf

    checkpoint = make_checkpoint("gemma2_capped", tmp_path / "gemma2", num_hidden_layers=1)
    field = write_gguf(checkpoint, tmp_path / "field.gguf", extra_fields={"gemma2.attention.sliding_window_pattern": 3})
    with pytest.raises(CheckpointError, match=r"metadata field 'gemma2\.attention\.sliding_window_pattern'"):
        load_model(field)
    fused = np.zeros((64, 64), dtype=np.float32)
    tensor = write_gguf(checkpoint, tmp_path / "tensor.gguf", extra_tensors={"blk.0.attn_qkv.weight": fused})
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.attn_qkv\.weight' is not understood"):
        load_model(tensor)


def test_gemma2_of_27b_layers_takes_hidden_over_heads_as_its_attention_scale(tmp_path: Path) -> None:
    """The file carries no attention scale: llama.cpp takes hidden / heads for Gemma 2 27B
    (46 layers), which is its checkpoint's query_pre_attn_scalar, and head_dim otherwise."""
    from tests.checkpoints import make_checkpoint, write_gguf

    checkpoint = make_checkpoint(
        "gemma2_capped", tmp_path / "g27", num_hidden_layers=46, head_dim=24, query_pre_attn_scalar=16
    )
    ours = load_model(write_gguf(checkpoint, tmp_path / "g27.gguf"), load_weights=False).config
    assert ours.softmax_scale == load_model(checkpoint, load_weights=False).config.softmax_scale == 16**-0.5
