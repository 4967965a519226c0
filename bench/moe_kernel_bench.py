"""`python -m bench.moe_kernel_bench`: the fused MoE kernel (worker/backends/fused_moe.py) on
one layer of Qwen3-30B-A3B's, gpt-oss-20b's and gpt-oss-120b's experts, in bf16, FP8 and
MXFP4, at T tokens.

Per row: the fused call's time (replayed in a CUDA graph, as decode steps run it); a
dequantize-and-loop torch reference (each routed expert's weights dequantized to bf16, its
tokens gathered, two matmuls, eager: it reads the routing on the host); and the roofline,
the bytes of the experts the routing touches (weights, scales, biases) plus x and the
output, over the HBM bandwidth measured in the same run with a large copy. Routing is
uniform at random, as a trained router's is roughly over a batch; weights are random (the
format's bytes are what the time depends on).

`--tokens`, `--models`, `--formats` narrow the sweep; `--tile BM,BN,BK,WARPS,STAGES` runs
one tile at every T instead of fused_moe.TILES' choice (tuning).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from bench import SkipSection, log
from bench.device_rates import graph_call_seconds, measure_bandwidth, sync
from worker.backends.fused_moe import (
    Activation,
    ExpertWeights,
    Format,
    Tile,
    dequantize_expert,
    experts_from_float,
    experts_from_mxfp4,
    fused_moe,
    tile_for,
)


@dataclass(frozen=True, slots=True)
class MoeShape:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    activation: Activation
    biases: bool


SHAPES = (
    MoeShape("qwen3-30b-a3b", 2048, 768, 128, 8, "silu", False),
    MoeShape("gpt-oss-20b", 2880, 2880, 32, 4, "swiglu_clamped", True),
    MoeShape("gpt-oss-120b", 2880, 2880, 128, 4, "swiglu_clamped", True),
)
TOKENS = (1, 8, 64, 256, 1024, 4096)
FORMATS: tuple[Format, ...] = ("bf16", "fp8", "mxfp4")


def random_experts(shape: MoeShape, fmt: Format, device: torch.device) -> ExpertWeights:
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    gu_bias = torch.randn(e, 2 * i, device=device) if shape.biases else None
    d_bias = torch.randn(e, h, device=device) if shape.biases else None
    if fmt == "mxfp4":

        def blocks(out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
            codes = torch.randint(0, 256, (e, out, inp // 32, 16), dtype=torch.uint8, device=device)
            return codes, torch.randint(118, 122, (e, out, inp // 32), dtype=torch.uint8, device=device)

        return experts_from_mxfp4(*blocks(2 * i, h), *blocks(h, i), gu_bias, d_bias)
    gate_up = torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16) / h**0.5
    down = torch.randn(e, h, i, device=device, dtype=torch.bfloat16) / i**0.5
    return experts_from_float(gate_up, down, gu_bias, d_bias, format=fmt)


def reference_moe(x: torch.Tensor, experts: ExpertWeights, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  activation: Activation) -> torch.Tensor:  # fmt: skip
    """Each routed expert in turn: its weights dequantized to bf16, its tokens through them."""
    out = torch.zeros(x.shape[0], experts.hidden, dtype=torch.float32, device=x.device)
    i = experts.intermediate
    for e in topk_ids.unique().tolist():
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        gate_up, down = (w.to(torch.bfloat16) for w in dequantize_expert(experts, e))
        h = F.linear(x[tokens], gate_up, None if experts.gate_up_bias is None else experts.gate_up_bias[e].to(x.dtype))
        gate, up = h[:, :i].float(), h[:, i:].float()
        if activation == "silu":
            act = F.silu(gate) * up
        else:
            gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
            act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
        y = F.linear(act.to(x.dtype), down, None if experts.down_bias is None else experts.down_bias[e].to(x.dtype))
        out.index_add_(0, tokens, topk_weights[tokens, slots, None] * y.float())
    return out.to(x.dtype)


def eager_seconds(fn: Callable[[], object], device: torch.device, reps: int = 5) -> float:
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps


def layer_rows(shape: MoeShape, fmt: Format, tokens: list[int], tile: Tile | None, bandwidth: float,
               device: torch.device) -> list[list[str]]:  # fmt: skip
    """One layer in one format at each T: the table's rows."""
    experts = random_experts(shape, fmt, device)
    rows = []
    for t in tokens:
        x = torch.randn(t, shape.hidden, device=device).to(torch.bfloat16)
        ids = torch.rand(t, shape.experts, device=device).argsort(dim=1)[:, : shape.top_k].to(torch.int32)
        weights = torch.softmax(torch.randn(t, shape.top_k, device=device), dim=1)
        touched = int(ids.unique().numel())
        nbytes = touched * experts.nbytes_per_expert() + 2 * x.numel() * x.element_size()
        fused_s = graph_call_seconds(partial(fused_moe, x, experts, ids, weights, shape.activation, tile), device)
        ref_s = eager_seconds(partial(reference_moe, x, experts, ids, weights, shape.activation), device)
        roof_s = nbytes / bandwidth
        used = tile or tile_for(t, fmt)
        rows.append([shape.name, fmt, str(t), str(touched), f"{nbytes / 1e6:.1f}", f"{fused_s * 1e6:.1f}",
                     f"{ref_s * 1e6:.0f}", f"{roof_s * 1e6:.1f}", f"{fused_s / roof_s:.2f}", f"{ref_s / fused_s:.1f}",
                     f"{used.block_m}x{used.block_n}x{used.block_k}"])  # fmt: skip
        log(" | ".join(rows[-1]))
    return rows


def run(args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    device = torch.device("cuda")
    bandwidth = measure_bandwidth(device)
    log(f"HBM {bandwidth / 1e12:.2f} TB/s (a 4 GiB copy, measured now)")
    tile = Tile(*args.tile) if args.tile else None
    rows = []
    for shape in (s for s in SHAPES if s.name in args.models):
        for fmt in args.formats:
            rows += layer_rows(shape, fmt, args.tokens, tile, bandwidth, device)
            torch.cuda.empty_cache()  # the next format's copy of the experts
    header = ["layer", "weights", "T", "experts hit", "MB read", "fused us", "reference us", "roofline us",
              "fused / roofline", "reference / fused", "tile"]  # fmt: skip
    return header, rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=list(TOKENS))
    p.add_argument("--models", type=lambda s: s.split(","), default=[s.name for s in SHAPES])
    p.add_argument("--formats", type=lambda s: s.split(","), default=list(FORMATS))
    p.add_argument("--tile", type=lambda s: [int(v) for v in s.split(",")], default=None,
                   help="BM,BN,BK,WARPS,STAGES: one tile at every T (default: fused_moe.TILES)")  # fmt: skip
    return p


def table() -> tuple[list[str], list[list[str]]]:
    """`make bench` section: the whole sweep, on CUDA only."""
    if not torch.cuda.is_available():
        raise SkipSection("no CUDA device")
    return run(parser().parse_args([]))


def main() -> None:
    from bench.run import format_table

    header, rows = run(parser().parse_args())
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
