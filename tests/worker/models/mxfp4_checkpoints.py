"""A tiny gpt-oss checkpoint with its experts in MXFP4, as published (`*_blocks`, `*_scales`,
quant_method "mxfp4"), and its float twin holding exactly the values the codes stand for:
the CPU parity test's and the GPU tests' checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.checkpoints import make_checkpoint
from worker.models import mxfp4


def _quantize(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., n] float -> MXFP4 (blocks [..., n / 32, 16], scales [..., n / 32]): each block
    scaled by the power of two that brings its largest magnitude to at most 6, each value
    rounded to the nearest E2M1 code."""
    x = rows.reshape(*rows.shape[:-1], -1, mxfp4.BLOCK)
    exponent = np.ceil(np.log2(np.maximum(np.abs(x).max(-1), 1e-30) / 6.0)).astype(np.int32)
    codes = np.abs(x[..., None] / np.ldexp(1.0, exponent)[..., None, None] - mxfp4.E2M1).argmin(-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # C order: safetensors writes an array's buffer as it lies in memory
    return np.ascontiguousarray(blocks), np.ascontiguousarray(exponent + 127, np.uint8)


def mxfp4_and_float_twins(tmp_path: Path) -> tuple[Path, Path]:
    """(the MXFP4 checkpoint, its float32 twin), from transformers' tiny gpt-oss checkpoint."""
    from safetensors.numpy import load_file, save_file

    source = make_checkpoint("gpt_oss_sinks", tmp_path / "source")
    tensors = load_file(str(source / "model.safetensors"))
    packed, exact = dict(tensors), dict(tensors)
    for name, value in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _quantize(value.transpose(0, 2, 1))  # stored [experts, out, in]
            del packed[name]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            exact[name] = np.ascontiguousarray(mxfp4.dequantize(blocks, scales).transpose(0, 2, 1))
            assert not np.array_equal(exact[name], value)  # the codes are not the float weights
    twins = []
    for label, weights in (("mxfp4", packed), ("float", exact)):
        directory = tmp_path / label
        directory.mkdir()
        for file in source.iterdir():
            if file.name != "model.safetensors":
                (directory / file.name).write_bytes(file.read_bytes())
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
        twins.append(directory)
    config = json.loads((twins[0] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (twins[0] / "config.json").write_text(json.dumps(config))
    return twins[0], twins[1]
