"""Hugging Face checkpoint directories: config.json, *.safetensors (one file or sharded
with an index), tokenizer.json, tokenizer_config.json; read, and written back out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from worker.models.config import CheckpointError
from worker.models.families import family_of
from worker.models.loaded_model import LoadedModel, check_shapes
from worker.models.mxfp4_checkpoint import is_mxfp4, mxfp4_experts
from worker.models.quantized_checkpoint import recognise
from worker.models.safetensors_io import TensorRef, read_float32, read_header

INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: field 'weight_map' is missing")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.exists():
                raise CheckpointError(f"{index}: lists {file.name}, which is missing")
        return files
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights (other weight formats are not supported)")
    return files


def tensor_refs(directory: Path) -> dict[str, TensorRef]:
    refs: dict[str, TensorRef] = {}
    for file in _safetensors_files(directory):
        refs.update(read_header(file))
    return refs


def _chat_template(directory: Path, tok_cfg: dict[str, Any]) -> str | None:
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja = directory / "chat_template.jinja"
    return jinja.read_text() if jinja.exists() else None


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def load_hf_checkpoint(directory: Path, load_weights: bool = True) -> LoadedModel:
    config_path = directory / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{directory}: config.json is missing")
    hf_config = _read_json(config_path)
    try:
        family = family_of(hf_config.get("model_type"))  # before any other check
        config = family.config(hf_config)
    except CheckpointError as e:
        raise CheckpointError(f"{directory}/{e}") from e

    refs = tensor_refs(directory)
    needed = family.tensors(config)
    # gpt-oss's MXFP4 experts stay packed (read as the model is built); the rest of such a checkpoint is float.
    experts = mxfp4_experts(directory, refs, needed) if is_mxfp4(hf_config) else None
    if experts is not None:
        refs = {name: ref for name, ref in refs.items() if name not in experts.tensors}
    quant = None if experts is not None else recognise(directory, hf_config, refs, needed)
    quant_layers = {} if quant is None else quant.layers
    found = {name: ref.shape for name, ref in refs.items() if quant is None or name not in quant.tensors}
    check_shapes(directory, config, found | {name: shape for name, (shape, _) in quant_layers.items()}
                 | ({} if experts is None else experts.shapes))  # fmt: skip
    for name in found:
        if name not in needed and not family.ignores(name, config):
            raise CheckpointError(
                f"{directory}: tensor {name!r} is not part of a {config.model_type!r} checkpoint "
                "(the loader refuses tensors it would not use)"
            )
    refs = {name: ref for name, ref in refs.items() if name in needed and name not in quant_layers}
    weights = {name: read_float32(ref) for name, ref in refs.items()} if load_weights else {}
    quantized = {name: read() for name, (_, read) in quant_layers.items()} if load_weights else {}

    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.exists():
        raise CheckpointError(f"{directory}: tokenizer.json is missing")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tok_cfg_path = directory / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.exists() else {}

    # generate() stops on generation_config's eos ids, which may list more than config.json.
    gen_path = directory / "generation_config.json"
    gen_cfg = _read_json(gen_path) if gen_path.exists() else {}
    eos = tuple(dict.fromkeys(_ids(gen_cfg.get("eos_token_id")) + config.eos_token_ids))
    bos = gen_cfg.get("bos_token_id", config.bos_token_id)
    for name, token_id in [("eos_token_id", t) for t in eos] + [("bos_token_id", bos)]:
        if token_id is not None and not 0 <= token_id < config.vocab_size:
            raise CheckpointError(f"{directory}: {name} {token_id} is outside the vocabulary ({config.vocab_size})")
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        chat_template=_chat_template(directory, tok_cfg),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos,
        hf_config=hf_config,
        source=directory,
        tensor_refs=refs,
        tokenizer_config=tok_cfg,
        quantized=quantized,
        mxfp4_experts={} if experts is None else experts.packed,
        quantization="mxfp4 experts" if experts is not None else None if quant is None else quant.scheme,
    )


def save_hf_checkpoint(model: LoadedModel, directory: Path) -> None:
    """Write `model` as a float32 Hugging Face checkpoint that load_hf_checkpoint and
    transformers both read."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.hf_config, indent=2))
    weights = {name: np.ascontiguousarray(w, dtype=np.float32) for name, w in model.weights.items()}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model.tokenizer.save(str(directory / "tokenizer.json"))
    tok_cfg = dict(model.tokenizer_config)
    if model.chat_template is not None:
        tok_cfg["chat_template"] = model.chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    gen_cfg: dict[str, Any] = {"eos_token_id": list(model.eos_token_ids)}
    if model.bos_token_id is not None:
        gen_cfg["bos_token_id"] = model.bos_token_id
    (directory / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
