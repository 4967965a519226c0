"""gpt-oss checkpoints as published: each MoE layer's expert projections in MXFP4
(worker/models/mxfp4.py), `mlp.experts.gate_up_proj_blocks` [experts, 2I, hidden / 32, 16]
with `..._scales` [experts, 2I, hidden / 32] (rows of gate and up interleaved), and
`down_proj_blocks` / `_scales` likewise for [experts, hidden, I]; config.json says
`quantization_config: {"quant_method": "mxfp4"}`.

The experts stay packed: the loader hands each projection over under its float name
(`...mlp.experts.gate_up_proj`) as an `Mxfp4File`, read when the model builds that layer
(worker/models/moe_checkpoint.py makes it an `Mxfp4Tensor`). The CUDA backend copies the
packed bytes to the device for the fused expert kernel; the numpy and torch-CPU backends,
the reference, dequantize them to float32 layer by layer as they build the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.models import mxfp4
from worker.models.config import CheckpointError
from worker.models.safetensors_io import TensorRef, read_array

_PROJECTIONS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class Mxfp4File:
    """One layer's expert projection as the checkpoint packs it, rows first ([experts, out, in])."""

    blocks: TensorRef  # uint8 [experts, out, in / 32, 16]
    scales: TensorRef  # uint8 [experts, out, in / 32]

    def read(self) -> mxfp4.Mxfp4Tensor:
        return mxfp4.Mxfp4Tensor(read_array(self.blocks), read_array(self.scales))


@dataclass(frozen=True, slots=True)
class Mxfp4Experts:
    # float name ("...mlp.experts.gate_up_proj") -> its float shape ([experts, in, out])
    shapes: dict[str, tuple[int, ...]]
    packed: dict[str, Mxfp4File]  # float name -> where its blocks and scales are
    tensors: frozenset[str]  # the checkpoint's blocks and scales


def is_mxfp4(hf_config: dict[str, Any]) -> bool:
    qc = hf_config.get("quantization_config")
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "mxfp4"


def mxfp4_experts(source: Path, refs: dict[str, TensorRef], expected: dict[str, tuple[int, ...]]) -> Mxfp4Experts:
    """The expert projections that `expected` names, each from its blocks and scales
    (checked for dtype and shape here, read later); CheckpointError names a missing or
    wrong one."""
    shapes: dict[str, tuple[int, ...]] = {}
    packed: dict[str, Mxfp4File] = {}
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
        shapes[name], packed[name] = shape, Mxfp4File(blocks, scales)
    used = frozenset(n for name in packed for n in (name + "_blocks", name + "_scales"))
    return Mxfp4Experts(shapes, packed, used)


def _ref(source: Path, refs: dict[str, TensorRef], name: str) -> TensorRef:
    ref = refs.get(name)
    if ref is None:
        raise CheckpointError(f"{source}: tensor {name!r} is missing")
    if ref.dtype != "U8":
        raise CheckpointError(f"{source}: tensor {name!r} has dtype {ref.dtype}, expected U8 (MXFP4)")
    return ref
