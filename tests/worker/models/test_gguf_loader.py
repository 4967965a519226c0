"""GGUF loading on the default model, with transformers loading the same file as the oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.worker.backends.paged_batches import PagedSequences
from worker.backends.numpy_backend import NumpyBackend
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
