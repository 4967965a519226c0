"""Programmatic dependent launch (PDL, compute capability 9.0 and up) for our Triton
kernels. A kernel launched with it may be scheduled while the kernel before it in the
stream is still running its last programs; its programs wait (`gdc_wait`, at their
very start, before any load) until that kernel has finished and its writes are visible,
and signal (`gdc_launch_dependents`) that the next kernel may be scheduled likewise.
Within a CUDA graph the launches keep this as programmatic edges.

Why: a batch-1 decode step of an 8B model is about 320 short kernels back to back, and
each boundary costs the next kernel's launch and ramp-up while the GPU drains the last
one; with PDL the next kernel is resident and waiting when its predecessor ends, and the
GEMV reads its first weight tile before it waits. On the H100 the 8B's batch-1 time per
output token went from 5.81 to 5.57 ms (1.16x to 1.12x its 4.99 ms floor).

Only one-row steps use it. There every kernel is ours (the GEMV, not cuBLAS). In larger
steps our kernels follow cuBLAS GEMMs, which let their dependents in early; our waiting
programs then hold SM slots the GEMM's last wave needs, and prefill steps took 3 % longer
(183 -> 190 ms for 64 x 128 tokens; bench/results/pdl_h100_2026-11-27.txt).

Every kernel launched with PDL must call `wait` before it reads anything a predecessor
wrote and before any program may exit, so that its end still implies its predecessors'
(a chain of PDL kernels stays ordered)."""

from __future__ import annotations

import functools
from typing import Any

import torch

try:
    import triton  # type: ignore[import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # the CPU host
    triton = None

# Off: every launch waits for its predecessor to finish (bench.gpu_bench --no-pdl).
enabled = True


@functools.cache
def _supported(device_index: int) -> bool:
    cuda = getattr(getattr(tl, "extra", None), "cuda", None) if triton is not None else None
    return hasattr(cuda, "gdc_wait") and torch.cuda.get_device_capability(device_index)[0] >= 9


def options(device: torch.device, rows: int) -> dict[str, Any]:
    """A kernel's launch options (its PDL constexpr, and Triton's launch_pdl) in a step of
    `rows` tokens on `device`."""
    if enabled and rows == 1 and device.type == "cuda" and _supported(device.index or 0):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


if triton is not None:

    @triton.jit  # type: ignore[misc,unused-ignore]
    def wait(PDL: tl.constexpr):  # type: ignore[no-untyped-def]
        """At a PDL kernel's start: wait for the kernel before, then let the next one in."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
