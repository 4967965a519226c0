"""GGUF files (llama.cpp): dequantized weights under Hugging Face names, the config
rebuilt from the metadata, and the tokenizer rebuilt from the vocabulary it stores.

What each architecture's names, metadata and tensor layout stand for is
worker/models/gguf_architectures.py; beyond the names, a file differs from a Hugging Face
checkpoint in that:
- llama.cpp's converter reorders the rows of each Llama q/k projection head from the
  rotate-half layout to interleaved pairs, and stores Gemma's norms as 1 + weight;
  loading undoes both.
- There is no tokenizer.json: the vocabulary is metadata (worker/models/gguf_tokenizer.py).
- A tensor the architecture does not have fails the load naming it, as does a
  `{arch}.*` metadata field no reader took.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from worker.models.config import CheckpointError, ModelConfig
from worker.models.families import family_of
from worker.models.gguf_architectures import ARCHITECTURES, FileTensors, Metadata, architecture_of, shape_fields
from worker.models.gguf_tokenizer import build_tokenizer, tokenizer_config
from worker.models.loaded_model import LoadedModel, check_shapes


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor of `arch`, or None for tensors it does not have."""
    return ARCHITECTURES[arch].hf_tensor_name(gguf_name)


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k reordering: within each head, rows stored as interleaved
    (pair, half) go back to Hugging Face's rotate-half order (half, pair)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _metadata(reader: Any) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def _hf_config(meta: dict[str, Any], path: Path, arch: str, tensors: FileTensors) -> dict[str, Any]:
    """config.json as the architecture's family would have it, rebuilt from the metadata."""
    m = Metadata(meta, arch, path)
    architecture = ARCHITECTURES[arch]
    shape = shape_fields(m, tensors)
    # The embedding's rows: Gemma 3's converter drops those past the tokenizer's
    # vocabulary, which {arch}.vocab_size may still count.
    m.get("vocab_size")
    if "token_embd.weight" not in tensors.shapes:
        raise CheckpointError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = tensors.shapes["token_embd.weight"][0]
    cfg: dict[str, Any] = {
        "architectures": [architecture.hf_class],
        "model_type": architecture.model_type,
        "vocab_size": int(vocab),
        **shape,
        **architecture.config(m, tensors, shape),
        "torch_dtype": "float32",
    }
    m.check_all_read()
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            cfg[key] = int(value)
    return cfg


def load_gguf(path: Path, progress: Callable[[int, int], None] | None = None) -> LoadedModel:
    """Load a GGUF file; `progress(done, total)` is called as tensors are dequantized."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file: {e}") from e
    meta = _metadata(reader)
    arch, architecture = architecture_of(meta, path)
    by_name = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in by_name:
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' (per-dimension RoPE factors) is not supported")
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}  # GGML: fastest dim first

    def dequantized(t: Any) -> np.ndarray:
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shapes[t.name])

    tensors = FileTensors(shapes, lambda name: dequantized(by_name[name]))
    hf_config = _hf_config(meta, path, arch, tensors)
    config = ModelConfig.from_hf(hf_config)

    expected = family_of(config.model_type).tensors(config)
    names: dict[str, str] = {}
    for t in reader.tensors:
        if t.name in architecture.config_tensors:
            continue
        name = architecture.hf_tensor_name(t.name)
        if name is None or name not in expected:
            raise CheckpointError(f"{path}: tensor {t.name!r} is not understood for architecture {arch!r}")
        names[t.name] = name
    check_shapes(path, config, {name: shapes[g] for g, name in names.items()})

    weights: dict[str, np.ndarray] = {}
    for done, t in enumerate(reader.tensors, 1):
        if progress is not None:
            progress(done, len(reader.tensors))
        if t.name not in names:
            continue
        name, w = names[t.name], dequantized(t)
        if architecture.permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if name.endswith("q_proj.weight") else config.num_kv_heads
            w = unpermute_rows(w, heads)
        if architecture.norms_plus_one and t.name.endswith("norm.weight"):
            w = w - 1.0
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
        tokenizer_config=tokenizer_config(meta),
    )
