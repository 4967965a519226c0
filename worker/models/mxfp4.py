"""MXFP4, the OCP Microscaling 4-bit format gpt-oss ships its expert weights in.

A block of 32 values shares one E8M0 scale (a byte s: 2 ** (s - 127); 255 is NaN), and
each value is an E2M1 number (a sign bit, two exponent bits with bias 1, one mantissa
bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives). Checkpoints pack two values per
byte, the even-indexed element in the low nibble: `blocks` [..., G, 16] uint8 with
`scales` [..., G] uint8 hold a [..., G * 32] matrix. `Mxfp4Tensor` holds a layer's experts
packed so (the CUDA expert kernel reads them so), and dequantizes one expert at a time for
the backends that compute in float.

Written here because the format is a dozen lines of bit arithmetic and no maintained
library reads it without pulling in a GPU kernel package.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

BLOCK = 32  # values per shared scale


def _e2m1_values() -> np.ndarray:
    """The 16 E2M1 codes' values, from the format's definition."""
    codes = np.arange(16)
    sign = np.where(codes & 0b1000, -1.0, 1.0)
    exponent, mantissa = (codes >> 1) & 0b11, codes & 1
    # exponent 0 is subnormal: 2 ** (1 - bias) * (mantissa / 2) with bias 1
    magnitude = np.where(exponent == 0, 0.5 * mantissa, 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa))
    return (sign * magnitude).astype(np.float32)


E2M1 = _e2m1_values()


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., G * 32] from packed `blocks` [..., G, 16] and `scales` [..., G] (uint8)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8 (got {blocks.dtype} and {scales.dtype})")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}: "
            f"blocks are [..., G, {BLOCK // 2}] for scales [..., G]"
        )
    values = np.empty((*blocks.shape[:-1], BLOCK), np.float32)
    values[..., 0::2] = E2M1[blocks & 0x0F]
    values[..., 1::2] = E2M1[blocks >> 4]
    nan = scales == 255
    factor = np.ldexp(np.float32(1.0), np.where(nan, 127, scales).astype(np.int32) - 127).astype(np.float32)
    factor[nan] = np.nan
    values *= factor[..., None]
    return values.reshape((*blocks.shape[:-2], blocks.shape[-2] * BLOCK))


@dataclass(frozen=True, slots=True, eq=False)  # arrays: compared and hashed by identity
class Mxfp4Tensor(Sequence[np.ndarray]):
    """A layer's expert weights [experts, out, in], packed: `blocks` uint8 [experts, out,
    in / 32, 16] and `scales` uint8 [experts, out, in / 32], numpy arrays or torch tensors on
    any device. As a sequence it is the experts' float32 [out, in] matrices, each dequantized
    when taken, so a backend that computes in float reads it as it reads float experts."""

    blocks: Any
    scales: Any

    def __len__(self) -> int:
        return int(self.scales.shape[0])

    @overload
    def __getitem__(self, expert: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, expert: slice) -> Mxfp4Tensor: ...

    def __getitem__(self, expert: int | slice) -> np.ndarray | Mxfp4Tensor:
        """Expert `expert` dequantized; a slice of experts stays packed."""
        if isinstance(expert, slice):
            return Mxfp4Tensor(self.blocks[expert], self.scales[expert])
        return dequantize(_host(self.blocks[expert]), _host(self.scales[expert]))

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[e] for e in range(len(self)))

    def rows(self, index: slice) -> Mxfp4Tensor:
        """The output rows `index` of every expert (a view where the arrays allow one)."""
        return Mxfp4Tensor(self.blocks[:, index], self.scales[:, index])

    def columns(self, start: int, stop: int) -> Mxfp4Tensor:
        """The input columns start .. stop - 1 of every expert: whole blocks of 32."""
        if start % BLOCK or stop % BLOCK:
            raise ValueError(f"columns {start}..{stop} of MXFP4 weights do not fall on blocks of {BLOCK}")
        cut = slice(start // BLOCK, stop // BLOCK)
        return Mxfp4Tensor(self.blocks[:, :, cut], self.scales[:, :, cut])


def _host(array: Any) -> np.ndarray:
    """A numpy array of a numpy array or a torch tensor (copied to the host if on a device)."""
    return array.cpu().numpy() if hasattr(array, "cpu") else np.asarray(array)
