"""GGUF files (llama.cpp): dequantized weights under Hugging Face names, the config
rebuilt from the metadata, and the tokenizer rebuilt from the vocabulary it stores.

Two things differ from a Hugging Face checkpoint beyond the names:
- llama.cpp's converter reorders the rows of each Llama q/k projection head from the
  rotate-half layout to interleaved pairs; loading undoes that.
- There is no tokenizer.json: tokens, merges, token types and special ids are metadata.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from worker.models.config import CheckpointError, ModelConfig
from worker.models.loaded_model import LoadedModel, check_shapes

# general.architecture -> Hugging Face model_type. llama.cpp files Mistral under "llama".
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Architectures whose q/k rows llama.cpp permutes on conversion.
_PERMUTED = {"llama"}
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> the pre-tokenizer split regex the vocabulary was trained with.
# None means the ByteLevel pre-tokenizer's own (GPT-2) regex.
_GPT2_SPLIT = None
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": _GPT2_SPLIT,
    "gpt-2": _GPT2_SPLIT,
    "smollm": _GPT2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's per-head norms
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor, or None for tensors the decoder does not use."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    return None


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k reordering: within each head, rows stored as interleaved
    (pair, half) go back to Hugging Face's rotate-half order (half, pair)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _metadata(reader: Any) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def _hf_config(meta: dict[str, Any], path: Path, has_output: bool, has_bias: bool) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise CheckpointError(
            f"{path}: general.architecture {arch!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
        )

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise CheckpointError(f"{path}: metadata field {full!r} is missing")
        return meta[full]

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise CheckpointError(f"{path}: metadata gives no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)")
    cfg: dict[str, Any] = {
        "architectures": [_HF_CLASSES[arch]],
        "model_type": _ARCHITECTURES[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": not has_output,
        "attention_bias": has_bias,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        scaling: dict[str, Any] = {"rope_type": scaling_type, "factor": float(need("rope.scaling.factor"))}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        cfg["rope_scaling"] = scaling
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            cfg[key] = int(value)
    return cfg


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(meta: dict[str, Any], path: Path) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from llama.cpp's tokenizer metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(_PRE_TOKENIZER_SPLITS)})"
        )
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in meta:
            raise CheckpointError(f"{path}: metadata field {key!r} is missing")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Tokens with characters outside the byte alphabet are stored as plain text; respell them.
    vocab = {
        (t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, continuing_subword_prefix="", end_of_word_suffix="")
    )
    split = _PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must match whole and count as special; a
    # "control" token spelled outside the byte alphabet is a llama.cpp mislabel, skipped.
    control = [t for t, ty in zip(tokens, types, strict=True) if ty == _TOKEN_CONTROL and set(t) <= spelled]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == _TOKEN_USER_DEFINED and t in vocab]
    if user:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_text = tokens[int(bos)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_text}:0 $A:0", pair=f"{bos_text}:0 $A:0 $B:1", special_tokens=[(bos_text, int(bos))]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta.get("tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {"add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False))}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            cfg[f"{name}_token"] = tokens[int(token_id)]
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    return cfg


def load_gguf(path: Path, progress: Callable[[int, int], None] | None = None) -> LoadedModel:
    """Load a GGUF file; `progress(done, total)` is called as tensors are dequantized."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file: {e}") from e
    meta = _metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in by_name:
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' (per-dimension RoPE factors) is not supported")
    hf_config = _hf_config(meta, path, "output.weight" in by_name, "blk.0.attn_q.bias" in by_name)
    config = ModelConfig.from_hf(hf_config)

    shapes = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is not None:
            shapes[name] = tuple(int(n) for n in reversed(t.shape))  # GGML lists dims fastest first
    check_shapes(path, config, shapes)

    weights: dict[str, np.ndarray] = {}
    for done, t in enumerate(reader.tensors, 1):
        name = hf_tensor_name(t.name)
        if progress is not None:
            progress(done, len(reader.tensors))
        if name is None:
            continue
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shapes[name])
        if hf_config["model_type"] in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if name.endswith("q_proj.weight") else config.num_kv_heads
            w = unpermute_rows(w, heads)
        weights[name] = np.ascontiguousarray(w)

    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=build_tokenizer(meta, path),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        hf_config=hf_config,
        source=path,
        tokenizer_config=_tokenizer_config(meta),
    )
