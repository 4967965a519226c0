"""A mixture-of-experts layer in torch: routing (worker/models/moe_routing.py's
definition, step by step), then the experts. On CUDA in bf16 the fused kernel
(worker/backends/fused_moe.py: tokens sorted by expert on the device, two grouped-GEMM
launches, no host read, so decode steps are captured in CUDA graphs) computes them, from
bf16, FP8 or MXFP4 expert weights (gpt-oss's, as its checkpoint packs them:
`mxfp4_experts`). Elsewhere (the CPU, float32 on CUDA) `run_experts` is a loop
over the experts that took rows: gather the rows, gate_up, activation, down, add back
weighted (index_add_). The expert weights are stacked per layer (`gate_up` [experts,
2 * intermediate, hidden], gate rows then up rows; `down` [experts, hidden, intermediate]).
Under expert parallelism (worker/parallel/expert_parallel.py) a layer stacks a contiguous
run of the experts, from `first_expert` on: routing still picks among all of them, and
rows routed to experts the layer does not hold get nothing from it.

The router statistics are a device tensor the layer adds to (no host sync here); the
backend reads it once per step, where the step already waits for its results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.backends.fused_moe import ExpertWeights, experts_from_mxfp4, fused_moe
from worker.models.config import ModelConfig
from worker.models.expert_act import SWIGLU_ALPHA, SWIGLU_LIMIT
from worker.models.mxfp4 import Mxfp4Tensor


@dataclass(frozen=True, slots=True)
class TorchExperts:
    router: torch.Tensor  # [experts, hidden]
    router_bias: torch.Tensor | None  # [experts]
    # [experts, 2 * intermediate, hidden]: gate rows, then up rows; and [experts, hidden,
    # intermediate]. None where `fused` holds them quantized (FP8, MXFP4) and nothing else reads them.
    gate_up: torch.Tensor | None
    down: torch.Tensor | None
    gate_up_bias: torch.Tensor | None  # [experts, 2 * intermediate]
    down_bias: torch.Tensor | None  # [experts, hidden]
    fused: ExpertWeights | None = None  # what the fused kernel reads (CUDA, bf16 activations)
    # The global id of the first stacked expert; None: every expert is stacked (no expert parallelism).
    first_expert: int | None = None


def mxfp4_experts(gate: Mxfp4Tensor, up: Mxfp4Tensor, down: Mxfp4Tensor, gate_up_bias: torch.Tensor | None,
                  down_bias: torch.Tensor | None, device: torch.device) -> ExpertWeights:  # fmt: skip
    """The fused kernel's MXFP4 experts from a layer's packed projections ([experts, out,
    in] each), gate rows then up rows, copied to `device` and laid out for the kernel
    (experts_from_mxfp4): a weight keeps its half byte (and its block's scale byte), nothing
    is dequantized."""

    def on_device(array: object) -> torch.Tensor:
        return torch.as_tensor(array, device=device)

    return experts_from_mxfp4(
        torch.cat([on_device(gate.blocks), on_device(up.blocks)], dim=1),
        torch.cat([on_device(gate.scales), on_device(up.scales)], dim=1),
        on_device(down.blocks), on_device(down.scales), gate_up_bias, down_bias,
    )  # fmt: skip


def route(logits: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [N, k] int64, weights [N, k] float32) from router logits [N, experts]."""
    logits = logits.float()
    k = config.experts_per_token
    if config.router == "topk_softmax":
        top, index = torch.topk(logits, k, dim=-1)
        return index, torch.softmax(top, dim=-1)
    weights, index = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    if config.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return index, weights


def expert_act(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    """[N, 2I] (gate, then up) -> [N, I], as worker/models/expert_act.py defines it."""
    gate, up = gate_up.chunk(2, dim=-1)
    if kind == "swiglu_clamped":
        gate = gate.clamp(max=SWIGLU_LIMIT)
        up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
        return (up + 1) * gate * torch.sigmoid(gate * SWIGLU_ALPHA)
    return F.silu(gate) * up


def experts_out(x: torch.Tensor, experts: TorchExperts, chosen: torch.Tensor, weights: torch.Tensor,
                act: str) -> torch.Tensor:  # fmt: skip
    """x [N, hidden] -> the routed sum [N, hidden]; chosen, weights [N, k]: the fused
    kernel where the layer has its weights, else the loop."""
    if experts.fused is not None:
        return fused_moe(x, experts.fused, chosen.to(torch.int32), weights, act,  # type: ignore[arg-type]
                         expert_start=experts.first_expert)  # fmt: skip
    return run_experts(x, experts, chosen, weights, act)


def run_experts(x: torch.Tensor, experts: TorchExperts, chosen: torch.Tensor, weights: torch.Tensor,
                act: str) -> torch.Tensor:  # fmt: skip
    """x [N, hidden] -> the routed sum [N, hidden] over the experts the layer holds; chosen,
    weights [N, k] (global expert ids)."""
    assert experts.gate_up is not None and experts.down is not None
    out = torch.zeros_like(x)
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    first = experts.first_expert or 0
    held = experts.gate_up.shape[0]
    counts = torch.bincount(flat, minlength=first + held).tolist()  # the loop's one host read
    k = chosen.shape[1]
    start = sum(counts[:first])  # the picks of the experts before the held ones, sorted first
    for e, n in enumerate(counts[first : first + held]):
        if n == 0:
            continue
        picks = order[start : start + n]
        start += n
        rows = picks // k
        y = F.linear(x.index_select(0, rows), experts.gate_up[e],
                     None if experts.gate_up_bias is None else experts.gate_up_bias[e])  # fmt: skip
        y = F.linear(expert_act(y, act), experts.down[e], None if experts.down_bias is None else experts.down_bias[e])
        w = weights.flatten().index_select(0, picks)[:, None]
        out.index_add_(0, rows, (y.float() * w).to(x.dtype))
    return out
