"""The SM count the Triton kernels size their grids by (split-K, flash-decoding, chunks
of a row), cached per CUDA device. On the CPU, where the kernels run in Triton's
interpreter (tests), a small stand-in, so that the plans still split their work."""

from __future__ import annotations

import torch

# The interpreter's stand-in; a test may lower it to make a plan split further.
INTERPRETER_SMS = 4
_CACHE: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CACHE:
        _CACHE[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _CACHE[index]
