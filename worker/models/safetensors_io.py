"""Reading safetensors files with numpy alone, bf16 included.

numpy has no bfloat16, and safetensors' numpy loader refuses it, so the header is
parsed here and each tensor is memory-mapped and widened to float32 by hand (a
bf16 value is the top 16 bits of a float32).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from worker.models.config import CheckpointError

_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where one tensor lives on disk; enough for any framework to read it directly."""

    file: Path
    dtype: str  # safetensors dtype name: "F32", "BF16", "F16", ...
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    end: int


def read_header(file: Path) -> dict[str, TensorRef]:
    with file.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise CheckpointError(f"{file}: not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > 100_000_000:
            raise CheckpointError(f"{file}: not a safetensors file (header length {header_len})")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise CheckpointError(f"{file}: unreadable safetensors header: {e}") from e
    base = 8 + header_len
    refs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        refs[name] = TensorRef(file, info["dtype"], tuple(info["shape"]), base + start, base + end)
    return refs


def read_float32(ref: TensorRef) -> np.ndarray:
    """The tensor as a float32 array (a fresh array, not a view of the file)."""
    np_dtype = _NUMPY_DTYPES.get(ref.dtype)
    if np_dtype is None:
        raise CheckpointError(f"{ref.file}: tensor dtype {ref.dtype} is not supported (want F32, F16, BF16, F64)")
    count = int(np.prod(ref.shape, dtype=np.int64))
    if (ref.end - ref.start) != count * np.dtype(np_dtype).itemsize:
        raise CheckpointError(f"{ref.file}: tensor byte range does not match its shape {ref.shape} and {ref.dtype}")
    raw = np.memmap(ref.file, dtype=np_dtype, mode="r", offset=ref.start, shape=(count,))
    if ref.dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(ref.shape)
    return raw.astype(np.float32).reshape(ref.shape)


# Raw element types of quantized checkpoints: e4m3 weights come back as their uint8 bit patterns.
_RAW_DTYPES = {"F8_E4M3": np.uint8, "I8": np.int8, "U8": np.uint8, "I32": np.int32, "I64": np.int64}


def read_array(ref: TensorRef) -> np.ndarray:
    """An integer or float8 tensor as stored (a fresh array, not a view of the file)."""
    np_dtype = _RAW_DTYPES.get(ref.dtype)
    if np_dtype is None:
        raise CheckpointError(f"{ref.file}: tensor dtype {ref.dtype} is not a quantized element type")
    count = int(np.prod(ref.shape, dtype=np.int64))
    if (ref.end - ref.start) != count * np.dtype(np_dtype).itemsize:
        raise CheckpointError(f"{ref.file}: tensor byte range does not match its shape {ref.shape} and {ref.dtype}")
    return np.array(np.memmap(ref.file, dtype=np_dtype, mode="r", offset=ref.start, shape=(count,))).reshape(ref.shape)
