"""Quantized Hugging Face checkpoints, recognised from config.json's `quantization_config`,
read into worker.models.quantization's formats.

- compressed-tensors (what llm-compressor writes): FP8 W8A8 `float-quantized` (e4m3
  `weight` with a per-tensor or per-channel `weight_scale`; activations static through
  `input_scale` or dynamic per token) and INT4 W4A16 `pack-quantized` (`weight_packed`,
  `weight_scale` per group, `weight_zero_point` when asymmetric, `weight_shape`).
- AWQ, AutoAWQ's "gemm" layout: `qweight` int32 [in, out // 8] and `qzeros` int32
  [in // group, out // 8], eight unsigned nibbles a word in the order 0, 2, 4, 6, 1, 3,
  5, 7; `scales` float16 [in // group, out]; w = (q - zero) * scale.

Every tensor is checked against the shape the config implies before anything is read,
and a mismatch names the tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.models.config import CheckpointError
from worker.models.quantization import Fp8Weight, Int4Weight, QuantizedWeight, pack_int4, unpack_int4
from worker.models.safetensors_io import TensorRef, read_array, read_float32

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8w + _AWQ_ORDER[i]


@dataclass(frozen=True, slots=True)
class QuantizedCheckpoint:
    scheme: str  # for logs and the worker's Ready: "compressed-tensors fp8 (w: channel, a: dynamic token)"
    # Hugging Face weight name ("...q_proj.weight") -> its logical shape and a reader.
    layers: dict[str, tuple[tuple[int, int], Callable[[], QuantizedWeight]]]
    tensors: frozenset[str]  # every checkpoint tensor the quantized layers consist of


def _first_layer(refs: dict[str, TensorRef], suffixes: tuple[str, ...]) -> str:
    for name in sorted(refs):
        for suffix in suffixes:
            if name.endswith(suffix):
                return name.removesuffix(suffix)
    return "(no quantized layer found)"


def recognise(
    source: Path, hf_config: dict[str, Any], refs: dict[str, TensorRef], expected: dict[str, tuple[int, ...]]
) -> QuantizedCheckpoint | None:
    """The checkpoint's quantized layers, checked; None for a float checkpoint. Raises
    CheckpointError for a scheme tokenwire does not run, naming it and a layer."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{source}/config.json: quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(source, qc, refs, expected)
    if method == "awq":
        return _awq(source, qc, refs, expected)
    layer = _first_layer(refs, (".qweight", ".weight_scale", ".scales", ".SCB"))
    raise CheckpointError(
        f"{source}: quant_method {method or qc.get('quant_method')!r} (layer {layer}) is not supported; "
        "tokenwire reads compressed-tensors (FP8 W8A8, INT4 W4A16 pack-quantized) and AWQ gemm"
    )


# -- checks -------------------------------------------------------------------------------


def _ref(source: Path, refs: dict[str, TensorRef], name: str, dtypes: tuple[str, ...]) -> TensorRef:
    ref = refs.get(name)
    if ref is None:
        raise CheckpointError(f"{source}: tensor {name!r} is missing")
    if ref.dtype not in dtypes:
        raise CheckpointError(f"{source}: tensor {name!r} has dtype {ref.dtype}, expected {' or '.join(dtypes)}")
    return ref


def _shape(source: Path, ref: TensorRef, name: str, allowed: tuple[tuple[int, ...], ...], what: str) -> None:
    if ref.shape not in allowed:
        want = " or ".join(str(s) for s in allowed)
        raise CheckpointError(f"{source}: tensor {name!r} has shape {ref.shape}, expected {want} ({what})")


def _groups(source: Path, name: str, n_in: int, group_size: int) -> int:
    if group_size <= 0 or n_in % group_size:
        raise CheckpointError(
            f"{source}: tensor {name!r}: group size {group_size} does not divide the layer's {n_in} inputs"
        )
    return n_in // group_size


def _linear_names(expected: dict[str, tuple[int, ...]], refs: dict[str, TensorRef], marker: str) -> list[str]:
    """The 2-D weights the config expects whose quantized form (`name` + marker) is there."""
    return [n for n, s in expected.items() if len(s) == 2 and n.removesuffix("weight") + marker in refs]


# -- compressed-tensors ---------------------------------------------------------------------


def _compressed_tensors(
    source: Path, qc: dict[str, Any], refs: dict[str, TensorRef], expected: dict[str, tuple[int, ...]]
) -> QuantizedCheckpoint:
    groups = qc.get("config_groups") or {}
    layer = _first_layer(refs, (".weight_scale", ".weight_packed"))
    if len(groups) != 1:
        raise CheckpointError(
            f"{source}: compressed-tensors with {len(groups)} config_groups (layer {layer}) is not supported (one)"
        )
    (group,) = groups.values()
    w, act = group.get("weights") or {}, group.get("input_activations")
    fmt = group.get("format") or qc.get("format")
    desc = (
        f"{fmt}: weights {w.get('type')} {w.get('num_bits')}-bit {w.get('strategy')}"
        + (f" group {w.get('group_size')}" if w.get("group_size") else "")
        + ("" if act is None else f", activations {act.get('type')} {act.get('num_bits')}-bit "
                                  f"{'dynamic' if act.get('dynamic') else 'static'} {act.get('strategy')}")
    )  # fmt: skip
    if qc.get("sparsity_config"):
        raise CheckpointError(f"{source}: compressed-tensors sparsity (layer {layer}) is not supported")
    static = act is not None and not act.get("dynamic")
    fp8_act = act is None or (
        act.get("type") == "float"
        and act.get("num_bits") == 8
        and act.get("strategy") == ("tensor" if static else "token")
    )
    if fmt == "float-quantized" and w.get("type") == "float" and w.get("num_bits") == 8 and fp8_act \
            and w.get("strategy") in ("tensor", "channel"):  # fmt: skip
        layers = {
            name: ((expected[name][0], expected[name][1]), _ct_fp8(source, refs, name, expected[name], static))
            for name in _linear_names(expected, refs, "weight_scale")
        }
        parts = ("weight", "weight_scale") + (("input_scale",) if static else ())
        return _checkpoint(f"compressed-tensors fp8 ({desc})", layers, parts)
    if fmt == "pack-quantized" and w.get("type") == "int" and w.get("num_bits") == 4 and act is None \
            and w.get("strategy") == "group":  # fmt: skip
        symmetric, size = bool(w.get("symmetric", True)), int(w.get("group_size") or 0)
        layers = {
            name: (
                (expected[name][0], expected[name][1]),
                _ct_int4(source, refs, name, expected[name], size, symmetric),
            )
            for name in _linear_names(expected, refs, "weight_packed")
        }
        parts = ("weight_packed", "weight_scale", "weight_shape") + (() if symmetric else ("weight_zero_point",))
        return _checkpoint(f"compressed-tensors int4 ({desc})", layers, parts)
    raise CheckpointError(
        f"{source}: compressed-tensors scheme {desc} (layer {layer}) is not supported; tokenwire reads "
        "FP8 W8A8 (float-quantized, per-tensor or per-channel weights) and INT4 W4A16 (pack-quantized, group)"
    )


def _checkpoint(
    scheme: str, layers: dict[str, tuple[tuple[int, int], Callable[[], QuantizedWeight]]], parts: tuple[str, ...]
) -> QuantizedCheckpoint:
    tensors = frozenset(name.removesuffix("weight") + part for name in layers for part in parts)
    return QuantizedCheckpoint(scheme, layers, tensors)


def _ct_fp8(
    source: Path, refs: dict[str, TensorRef], name: str, shape: tuple[int, ...], static: bool
) -> Callable[[], QuantizedWeight]:
    out, n_in = shape
    base = name.removesuffix("weight")
    weight = _ref(source, refs, name, ("F8_E4M3",))
    _shape(source, weight, name, ((out, n_in),), "from the config")
    scale = _ref(source, refs, base + "weight_scale", ("F32", "BF16", "F16"))
    _shape(source, scale, base + "weight_scale", ((), (1,), (out, 1), (out,)), "per-tensor or per-channel")
    inp = None
    if static:
        inp = _ref(source, refs, base + "input_scale", ("F32", "BF16", "F16"))
        _shape(source, inp, base + "input_scale", ((), (1,)), "static per-tensor")

    def read() -> QuantizedWeight:
        s = np.broadcast_to(read_float32(scale).reshape(-1), (out,)).astype(np.float32)
        return Fp8Weight(read_array(weight), s, None if inp is None else float(read_float32(inp).reshape(-1)[0]))

    return read


def _ct_int4(
    source: Path, refs: dict[str, TensorRef], name: str, shape: tuple[int, ...], group_size: int, symmetric: bool
) -> Callable[[], QuantizedWeight]:
    out, n_in = shape
    base = name.removesuffix("weight")
    packed = _ref(source, refs, base + "weight_packed", ("I32",))
    n_groups = _groups(source, base + "weight_packed", n_in, group_size)
    _shape(source, packed, base + "weight_packed", ((out, n_in // 8),), "int4 packed eight to an int32")
    scale = _ref(source, refs, base + "weight_scale", ("F32", "BF16", "F16"))
    _shape(source, scale, base + "weight_scale", ((out, n_groups),), f"one per group of {group_size}")
    logical = _ref(source, refs, base + "weight_shape", ("I64", "I32"))
    if tuple(int(v) for v in read_array(logical)) != (out, n_in):
        raise CheckpointError(f"{source}: tensor {base + 'weight_shape'!r} is not {(out, n_in)} from the config")
    zero = None
    if not symmetric:
        zero = _ref(source, refs, base + "weight_zero_point", ("I32",))
        _shape(source, zero, base + "weight_zero_point", ((-(-out // 8), n_groups),), "int4 packed along out")

    def read() -> QuantizedWeight:
        z = None if zero is None else unpack_int4(read_array(zero).T.copy())[:, :out].T.copy()
        return Int4Weight(read_array(packed), read_float32(scale), z, group_size)

    return read


# -- AWQ ------------------------------------------------------------------------------------


def _awq(
    source: Path, qc: dict[str, Any], refs: dict[str, TensorRef], expected: dict[str, tuple[int, ...]]
) -> QuantizedCheckpoint:
    version = str(qc.get("version", "gemm")).lower()
    bits, size, zero_point = qc.get("bits", qc.get("w_bit")), int(qc.get("group_size", qc.get("q_group_size", 0))), \
        qc.get("zero_point", True)  # fmt: skip
    layer = _first_layer(refs, (".qweight",))
    if version != "gemm" or bits != 4 or not zero_point:
        raise CheckpointError(
            f"{source}: AWQ version {version!r} bits {bits} zero_point {zero_point} (layer {layer}) is not supported; "
            "tokenwire reads AutoAWQ's gemm layout, 4-bit with zero points"
        )
    layers = {
        name: ((expected[name][0], expected[name][1]), _awq_layer(source, refs, name, expected[name], size))
        for name in _linear_names(expected, refs, "qweight")
    }
    return _checkpoint(f"awq gemm (int4 group {size})", layers, ("qweight", "qzeros", "scales"))


def _awq_unpack(words: np.ndarray) -> np.ndarray:
    """int32 [rows, cols // 8] in AWQ's nibble order -> unsigned values [rows, cols]."""
    u = words.view(np.uint32).astype(np.int64)
    values = np.empty((u.shape[0], u.shape[1], 8), dtype=np.int64)
    for i, column in enumerate(_AWQ_ORDER):
        values[:, :, column] = (u >> (4 * i)) & 0xF
    return values.reshape(u.shape[0], -1)


def _awq_layer(
    source: Path, refs: dict[str, TensorRef], name: str, shape: tuple[int, ...], group_size: int
) -> Callable[[], QuantizedWeight]:
    out, n_in = shape
    base = name.removesuffix("weight")
    qweight = _ref(source, refs, base + "qweight", ("I32",))
    n_groups = _groups(source, base + "qweight", n_in, group_size)
    _shape(source, qweight, base + "qweight", ((n_in, out // 8),), "AWQ gemm: [in, out // 8]")
    qzeros = _ref(source, refs, base + "qzeros", ("I32",))
    _shape(source, qzeros, base + "qzeros", ((n_groups, out // 8),), f"one per group of {group_size}")
    scales = _ref(source, refs, base + "scales", ("F16", "BF16", "F32"))
    _shape(source, scales, base + "scales", ((n_groups, out),), f"one per group of {group_size}")

    def read() -> QuantizedWeight:
        # Signed values q - 8 and zeros z - 8 leave (q - z) * scale as it is.
        q = _awq_unpack(read_array(qweight)).T - 8  # [out, in]
        z = _awq_unpack(read_array(qzeros)).T - 8  # [out, groups]
        return Int4Weight(pack_int4(q), read_float32(scales).T.copy(), z.astype(np.int8), group_size)

    return read
