"""Quantized linear weights: the two formats tokenwire computes with, made from the
checkpoint formats users have or from float weights at load, and their float reference.

- `Fp8Weight`: float8 e4m3 weights [out, in] with one float32 scale per output channel (a
  per-tensor scale is repeated), and the static activation scale when the checkpoint has
  one (else activations are quantized per token at run time).
- `Int4Weight`: 4-bit integers [out, in] packed eight to an int32 along `in` (value j of
  word w is column 8w + j, stored as q + 8: compressed-tensors' pack-quantized layout),
  one float32 scale per group of `group_size` inputs, and a zero point per group when
  asymmetric: w = (q - zero) * scale. Checkpoints store integer zero points (compressed-
  tensors, AWQ); quantizing on load keeps them as floats, so that a group's minimum and
  maximum are both exact grid points.

Quantize on load (`ON_LOAD`): "fp8" is per-channel e4m3 (activations per token, dynamic);
"int4" is group-wise round-to-nearest (RTN, not AWQ: no calibration), asymmetric (the
group's min..max over the 16 levels, float zero point), groups of 32 inputs: the most
accurate of the usual RTN choices, a width every model's layers divide, and llama.cpp's
Q4_0 / Q4_1 block. A GGUF Q4_1 model (the default model is one) is 4-bit already, in
blocks of 32 with w = d * q + m over its full 0..15 range: this scheme finds the same grid
(scale d, zero -m / d) and reproduces its weights to float32 rounding, so on such a model
int4 costs no accuracy. On float weights RTN is lossy: requantized on any other grid (group
64, or integer zero points) the default model keeps only 0.6 of its next-token argmaxes.

`dequantize` is the reference every backend agrees with: the numpy and torch-CPU backends
compute with it, and the GPU kernels are tested against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ON_LOAD = ("fp8", "int4")
INT4_GROUP_SIZE = 32  # on load (see above)
FP8_MAX = 448.0  # the largest finite float8 e4m3fn value


def _e4m3_values() -> np.ndarray:
    """The float value of each of the 256 e4m3fn bit patterns (NaN for 0x7f, 0xff)."""
    b = np.arange(256)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    mag[(exp == 15) & (man == 7)] = np.nan
    return (sign * mag).astype(np.float32)


E4M3_VALUES = _e4m3_values()
_POSITIVE = E4M3_VALUES[:127]  # codes 0x00..0x7e, increasing


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest e4m3fn (ties to the even code), saturating at
    +-448: the uint8 bit patterns."""
    mag = np.minimum(np.abs(x), FP8_MAX).astype(np.float32)
    hi = np.minimum(np.searchsorted(_POSITIVE, mag, side="left"), 126)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = mag - _POSITIVE[lo], _POSITIVE[hi] - mag
    code = np.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi).astype(np.uint8)
    return np.where(np.signbit(x), code | 0x80, code).astype(np.uint8)  # -0 keeps its sign, as in torch


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    codes: np.ndarray  # uint8 e4m3fn bit patterns [out, in]
    scale: np.ndarray  # float32 [out]
    input_scale: float | None  # static per-tensor activation scale; None: dynamic per token

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))


@dataclass(frozen=True, slots=True)
class Int4Weight:
    packed: np.ndarray  # int32 [out, in // 8], q + 8 in nibble j of word w for column 8w + j
    scale: np.ndarray  # float32 [out, in // group_size]
    # [out, in // group_size]: int8 in [-8, 7] from a checkpoint, float32 quantized on
    # load; None: symmetric
    zero: np.ndarray | None
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.packed.shape[0]), int(self.packed.shape[1]) * 8)


QuantizedWeight = Fp8Weight | Int4Weight


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int [out, in] in [-8, 7] -> int32 [out, in // 8] (see Int4Weight)."""
    u = (q.astype(np.int64) + 8).reshape(q.shape[0], -1, 8)
    words = np.zeros(u.shape[:2], dtype=np.int64)
    for j in range(8):
        words |= u[:, :, j] << (4 * j)
    return words.astype(np.uint32).view(np.int32)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """int32 [rows, cols // 8] -> int8 [rows, cols] in [-8, 7]."""
    words = packed.view(np.uint32).astype(np.int64)
    u = np.stack([(words >> (4 * j)) & 0xF for j in range(8)], axis=-1)
    return (u.reshape(packed.shape[0], -1) - 8).astype(np.int8)


def dequantize(w: QuantizedWeight) -> np.ndarray:
    """The float32 weight [out, in] the quantized values stand for."""
    if isinstance(w, Fp8Weight):
        return E4M3_VALUES[w.codes] * w.scale[:, None]
    q = unpack_int4(w.packed).astype(np.float32)
    out, n_in = q.shape
    groups = q.reshape(out, n_in // w.group_size, w.group_size)
    if w.zero is not None:
        groups -= w.zero[:, :, None]
    return (groups * w.scale[:, :, None]).reshape(out, n_in)


def _nonzero(scale: np.ndarray) -> np.ndarray:
    """float32 scales with 1 where a group (or channel) is all zeros."""
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)


def quantize_fp8(w: np.ndarray) -> Fp8Weight:
    """Per-output-channel e4m3: scale = row amax / 448."""
    w = np.asarray(w, dtype=np.float32)
    scale = _nonzero(np.abs(w).max(axis=1) / np.float32(FP8_MAX))
    return Fp8Weight(to_e4m3(w / scale[:, None]), scale, None)


def quantize_int4(w: np.ndarray, group_size: int = INT4_GROUP_SIZE, symmetric: bool = False) -> Int4Weight:
    """Group-wise round-to-nearest. Asymmetric (on load): scale = (max - min) / 15 and the
    float zero = -8 - min / scale, so min and max land on q = -8 and 7. Symmetric: scale =
    amax / 7, no zero."""
    w = np.asarray(w, dtype=np.float32)
    out, n_in = w.shape
    if group_size % 8:
        raise ValueError(f"int4 group size {group_size} is not a multiple of 8 (the inputs of a packed word)")
    if n_in % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide the layer's {n_in} inputs")
    groups = w.reshape(out, n_in // group_size, group_size)
    zero: np.ndarray | None = None
    if symmetric:
        scale = _nonzero(np.abs(groups).max(axis=2) / np.float32(7.0))
    else:
        lo = groups.min(axis=2)
        scale = _nonzero((groups.max(axis=2) - lo) / np.float32(15.0))
        zero = (np.float32(-8.0) - lo / scale).astype(np.float32)
    shifted = groups / scale[:, :, None] + (np.float32(0.0) if zero is None else zero[:, :, None])
    q = np.clip(np.rint(shifted), -8, 7).astype(np.int8).reshape(out, n_in)
    return Int4Weight(pack_int4(q), scale, zero, group_size)


def quantize(w: np.ndarray, mode: str) -> QuantizedWeight:
    if mode == "fp8":
        return quantize_fp8(w)
    if mode == "int4":
        return quantize_int4(w)
    raise ValueError(f"quantization must be one of {', '.join(ON_LOAD)}, got {mode!r}")


def check_mode(mode: str | None) -> None:
    if mode is not None and mode not in ON_LOAD:
        raise ValueError(f"quantization must be one of {', '.join(ON_LOAD)}, got {mode!r}")


@dataclass(frozen=True, slots=True)
class Fp8Inputs:
    """A linear layer whose input is rounded to e4m3 before its GEMM: scaled per token
    (row amax / 448) or, from a checkpoint with static activations, by one scale."""

    static_scale: float | None


def fp8_inputs(parts: Sequence[object], mode: str | None) -> Fp8Inputs | None:
    """How a projection's inputs are quantized: FP8 weights (a checkpoint's, or "fp8" on
    load) take FP8 inputs; fused parts share one input, so the largest static scale."""
    statics = [p.input_scale for p in parts if isinstance(p, Fp8Weight)]
    if statics:
        return Fp8Inputs(None if None in statics else max(s for s in statics if s is not None))
    return Fp8Inputs(None) if mode == "fp8" and not any(isinstance(p, Int4Weight) for p in parts) else None


def fake_quantize_inputs(x: np.ndarray, spec: Fp8Inputs) -> np.ndarray:
    """x [N, in] rounded to e4m3 as the GPU's FP8 GEMM sees it, back in float32."""
    if spec.static_scale is None:
        scale = np.maximum(np.abs(x).max(axis=1, keepdims=True) / FP8_MAX, np.float32(1e-12)).astype(np.float32)
    else:
        scale = np.float32(spec.static_scale)
    return E4M3_VALUES[to_e4m3(x / scale)] * scale


def reference_parts(parts: Sequence[object], mode: str | None) -> list[np.ndarray]:
    """A projection's row blocks as float32 arrays that carry the quantization error: a
    checkpoint's quantized weight dequantized, a float one quantized by `mode` then
    dequantized (or as it is without a mode). What the CPU backends compute with."""
    floats = []
    for part in parts:
        if isinstance(part, Fp8Weight | Int4Weight):
            floats.append(dequantize(part))
        elif mode is not None:
            floats.append(dequantize(quantize(np.asarray(part, dtype=np.float32), mode)))
        else:
            floats.append(np.asarray(part, dtype=np.float32))
    return floats
