"""gpt-oss checkpoints as published: each MoE layer's expert projections in MXFP4
(worker/models/mxfp4.py), `mlp.experts.gate_up_proj_blocks` [experts, 2I, hidden / 32, 16]
with `..._scales` [experts, 2I, hidden / 32] (rows of gate and up interleaved), and
`down_proj_blocks` / `_scales` likewise for [experts, hidden, I]; config.json says
`quantization_config: {"quant_method": "mxfp4"}`. The experts are dequantized on load to
float32 under the names and layout of a float checkpoint (`gate_up_proj` [experts,
hidden, 2I], `down_proj` [experts, I, hidden]), so the model is built as from one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.models import mxfp4
from worker.models.config import CheckpointError
from worker.models.safetensors_io import TensorRef, read_array

_PROJECTIONS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class Mxfp4Experts:
    # float name ("...mlp.experts.gate_up_proj") -> its float shape and a reader (float32)
    floats: dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]]
    tensors: frozenset[str]  # the checkpoint's blocks and scales they are read from


def is_mxfp4(hf_config: dict[str, Any]) -> bool:
    qc = hf_config.get("quantization_config")
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "mxfp4"


def mxfp4_experts(source: Path, refs: dict[str, TensorRef], expected: dict[str, tuple[int, ...]]) -> Mxfp4Experts:
    """The experts' float tensors that `expected` names, each from its blocks and scales
    (checked for dtype and shape first); CheckpointError names a missing or wrong one."""
    floats: dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]] = {}
    used: set[str] = set()
    for name, shape in expected.items():
        if not name.endswith(_PROJECTIONS) or ".mlp.experts." not in name:
            continue
        blocks, scales = _ref(source, refs, name + "_blocks"), _ref(source, refs, name + "_scales")
        experts, cols, rows = shape  # the float layout is [experts, in, out]; blocks hold [experts, out, in]
        want = (experts, rows, cols // mxfp4.BLOCK)
        if cols % mxfp4.BLOCK or blocks.shape != (*want, mxfp4.BLOCK // 2) or scales.shape != want:
            raise CheckpointError(
                f"{source}: MXFP4 tensors {name}_blocks {blocks.shape} / _scales {scales.shape} do not hold the "
                f"{list(shape)} the config implies (want {[*want, mxfp4.BLOCK // 2]} and {list(want)})"
            )
        floats[name] = (shape, _reader(blocks, scales))
        used |= {name + "_blocks", name + "_scales"}
    return Mxfp4Experts(floats, frozenset(used))


def _ref(source: Path, refs: dict[str, TensorRef], name: str) -> TensorRef:
    ref = refs.get(name)
    if ref is None:
        raise CheckpointError(f"{source}: tensor {name!r} is missing")
    if ref.dtype != "U8":
        raise CheckpointError(f"{source}: tensor {name!r} has dtype {ref.dtype}, expected U8 (MXFP4)")
    return ref


def _reader(blocks: TensorRef, scales: TensorRef) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        rows_first = mxfp4.dequantize(read_array(blocks), read_array(scales))  # [experts, out, in]
        return np.ascontiguousarray(rows_first.transpose(0, 2, 1))

    return read
