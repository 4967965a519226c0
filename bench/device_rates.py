"""What the device does, measured in the run: HBM bandwidth, the bf16 and FP8 GEMM rates
(in a burst and sustained), and a call's time replayed from a CUDA graph."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def measure_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 4 GiB device-to-device copy, counting bytes read plus bytes written."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / float(np.median(times))


SUSTAINED_S = 6.0


def product_rate(product: Callable[[], object], flop: float, device: torch.device, sustained_s: float = 0.0) -> float:
    """FLOP/s of `product` (`flop` a call): over 20 calls after 3 of warm-up, or, with
    `sustained_s`, over the second half of that many seconds of calls back to back. An H100
    SXM runs the first tens of ms of dense GEMMs at its boost clock; then its 700 W cap
    holds the SM clock at 1.35-1.5 GHz: 8192^3 bf16 at 791-800 TFLOP/s in 20 calls, ~675
    sustained; FP8 1434 against ~1178 (bench/results/power_cap_h100_2026-11-28.txt)."""
    for _ in range(3):
        product()
    sync(device)
    if not sustained_s:
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            product()
        sync(device)
        return flop * reps / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    calls, timed_from = 0, None
    while (now := time.perf_counter()) - t0 < sustained_s:
        if timed_from is None and now - t0 >= sustained_s / 2:
            calls, timed_from = 0, now
        for _ in range(4):
            product()
        calls += 4
        sync(device)
    assert timed_from is not None
    return flop * calls / (time.perf_counter() - timed_from)


def sustained_note(sustained_flops: float) -> str:
    """`; N sustained, ...` for a log line, or nothing when the rate was not measured (nan)."""
    if math.isnan(sustained_flops):
        return ""
    return f"; {sustained_flops / 1e12:.0f} sustained, the last {SUSTAINED_S / 2:.0f} s of {SUSTAINED_S:.0f}"


def measure_gemm(device: torch.device, sustained_s: float = 0.0) -> float:
    """bf16 FLOP/s of an 8192^3 matrix product on random data (product_rate)."""
    n = 8192 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return product_rate(lambda: a @ b, 2 * n**3, device, sustained_s)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_fp8_gemm(device: torch.device, sustained_s: float = 0.0) -> float:
    """FP8 FLOP/s of an 8192^3 torch._scaled_mm with row-wise scales, bf16 out (the GEMM
    Fp8Linear runs; product_rate)."""
    n = 8192
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    sa, sb = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)

    def mm() -> torch.Tensor:
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    return product_rate(mm, 2 * n**3, device, sustained_s)


def graph_call_seconds(fn: Any, device: torch.device) -> float:
    """Seconds per call of `fn`, 20 calls captured in one CUDA graph (no launch gaps)."""
    fn()  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        graph.replay()
    sync(device)
    return (time.perf_counter() - t0) / 200
