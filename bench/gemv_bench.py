"""`python -m bench.gemv_bench [--formats fp8,bf16]`: the one-row GEMV kernel
(worker/backends/gemv.py) on the Llama 3 8B's projections and LM head, at every tile of a
small grid, against the bytes its weights take at the copy bandwidth measured in the same
run. Each call reads a different copy of the weights (cold in L2, as in a decode step),
twenty calls in one CUDA graph. Prints, per projection, `_plan`'s tile and the four fastest;
the source of `_plan`'s table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from itertools import count, product

import torch

from bench.device_rates import graph_call_seconds, measure_bandwidth
from worker.backends import gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # fmt: skip
TILES = list(product((4, 8, 16), (512, 1024, 2048), (4, 8)))  # BLOCK_N, BLOCK_K, warps
COLD_BYTES = 200 << 20  # more than the H200's 50 MB L2 several times over


def sweep(fmt: str, name: str, n: int, k: int, bandwidth: float, device: torch.device) -> str:
    nbytes = n * k * (1 if fmt == "fp8" else 2)
    copies = max(2, -(-COLD_BYTES // nbytes))
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    if fmt == "fp8":
        weights = [w.to(torch.float8_e4m3fn) for w in weights]
        x = x.to(torch.float8_e4m3fn)
    x_scale, w_scale = torch.ones(1, 1, device=device), torch.ones(1, n, device=device)
    out = torch.empty((1, n), dtype=torch.bfloat16, device=device)

    def launcher(block_n: int, block_k: int, warps: int) -> Callable[[], None]:
        calls = count()

        def call() -> None:
            w = weights[next(calls) % copies]
            gemv._gemv_kernel[(-(-n // block_n),)](
                x, w, w, x_scale, w_scale, out, n, k, w.stride(0), HAS_BIAS=False, SCALED=fmt == "fp8",
                EVEN_K=k % block_k == 0, ROUND=False, SWIGLU=False, BLOCK_N=block_n, BLOCK_K=block_k, PDL=False,
                num_warps=warps, num_stages=3,
            )  # fmt: skip

        return call

    times = [(graph_call_seconds(launcher(*tile), device), tile) for tile in TILES if tile[1] <= k]
    plan = gemv._plan(n, k, 1 if fmt == "fp8" else 2)
    at_plan = {tile: t for t, tile in times}.get(plan)
    best = "  ".join(f"{tile} {t * 1e6:.1f}" for t, tile in sorted(times)[:4])
    plan_us = f"{at_plan * 1e6:6.1f}" if at_plan is not None else "     -"
    return f"{fmt:4s} {name:8s} {nbytes / bandwidth * 1e6:8.1f} {plan!s:16s} {plan_us}  {best}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", type=lambda s: s.split(","), default=["fp8", "bf16"])
    args = p.parse_args()
    device = torch.device("cuda")
    bandwidth = measure_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written); us a call")
    print(f"{'fmt':4s} {'proj':8s} {'floor':>8s} {'plan':16s} {'at plan':>6s}  fastest (BLOCK_N, BLOCK_K, warps)")
    for fmt in args.formats:
        for name, (n, k) in SHAPES.items():
            print(sweep(fmt, name, n, k, bandwidth, device), flush=True)


if __name__ == "__main__":
    main()
