"""The fused MoE kernel (worker/backends/fused_moe.py) on CUDA against a float32 reference:
the weights dequantized by each format's definition, every expert's tokens run through it
one expert at a time, the routing weights applied and the k experts summed.

Tolerance (relative L2 of the output): the weights reach the tensor cores exactly (e4m3
and e2m1 times a power of two are bf16 values), x is bf16 in both, and the products
accumulate in float32 (over H or I terms: ~sqrt(H) * 2^-24, nothing). What remains is the
bf16 rounding of the activation [T * k, I] and of the output, each at most 2^-9 relative
per element: ~3e-3 in relative L2 on random data; bound 1e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.backends.fused_moe import (
    CLAMPED_SWIGLU_ALPHA,
    CLAMPED_SWIGLU_LIMIT,
    MXFP4_TILES,
    TILES,
    ExpertWeights,
    Format,
    Tile,
    experts_from_float,
    experts_from_mxfp4,
    fused_moe,
    tile_for,
)
from worker.models import mxfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
BOUND = 1e-2
# H not a multiple of 128 (as gpt-oss's 2880): the last K step is masked, and the last
# 128x128 FP8 block is partial; I (INTER) not a multiple of the column tiles.
E, H, INTER = 8, 320, 160


def make_experts(fmt: str, bias: bool, seed: int = 0) -> tuple[ExpertWeights, torch.Tensor, torch.Tensor]:
    """(experts on the GPU, float32 gate_up [E, 2I, H], down [E, H, I] by the format's definition)."""
    g = torch.Generator().manual_seed(seed)
    gu_bias = torch.randn(E, 2 * INTER, generator=g) if bias else None
    d_bias = torch.randn(E, H, generator=g).to(torch.bfloat16) if bias else None
    gu_bias_gpu = None if gu_bias is None else gu_bias.to(CUDA)
    d_bias_gpu = None if d_bias is None else d_bias.to(CUDA)
    if fmt == "mxfp4":
        # random codes under scales of 2^-7..2^-4: entries of a few tenths, as trained weights
        gu_blocks = torch.randint(0, 256, (E, 2 * INTER, H // 32, 16), dtype=torch.uint8, generator=g)
        gu_scales = torch.randint(120, 124, (E, 2 * INTER, H // 32), dtype=torch.uint8, generator=g)
        d_blocks = torch.randint(0, 256, (E, H, INTER // 32, 16), dtype=torch.uint8, generator=g)
        d_scales = torch.randint(120, 124, (E, H, INTER // 32), dtype=torch.uint8, generator=g)
        experts = experts_from_mxfp4(gu_blocks.to(CUDA), gu_scales.to(CUDA), d_blocks.to(CUDA), d_scales.to(CUDA),
                                     gu_bias_gpu, d_bias_gpu)  # fmt: skip
        gate_up = torch.from_numpy(mxfp4.dequantize(gu_blocks.numpy(), gu_scales.numpy()))
        down = torch.from_numpy(mxfp4.dequantize(d_blocks.numpy(), d_scales.numpy()))
        return experts, gate_up, down
    w_gu = torch.randn(E, 2 * INTER, H, generator=g) / H**0.5
    w_d = torch.randn(E, H, INTER, generator=g) / INTER**0.5
    experts = experts_from_float(w_gu.to(CUDA), w_d.to(CUDA), gu_bias_gpu, d_bias_gpu, format=fmt)  # type: ignore[arg-type]
    gate_up, down = experts.gate_up.float().cpu(), experts.down.float().cpu()
    if fmt == "fp8":
        assert experts.gate_up_scale is not None and experts.down_scale is not None
        gate_up = gate_up * experts.gate_up_scale.cpu()[..., None]
        down = down * experts.down_scale.cpu()[..., None]
    elif fmt == "fp8_block":
        assert experts.gate_up_scale is not None and experts.down_scale is not None
        for w, s in ((gate_up, experts.gate_up_scale.cpu()), (down, experts.down_scale.cpu())):
            w *= s.repeat_interleave(128, 1)[:, : w.shape[1]].repeat_interleave(128, 2)[:, :, : w.shape[2]]
    return experts, gate_up, down


def reference(x: torch.Tensor, experts: ExpertWeights, gate_up: torch.Tensor, down: torch.Tensor,
              topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: str) -> torch.Tensor:  # fmt: skip
    """float32 [T, H], one expert at a time over the tokens routed to it."""
    x, ids, weights = x.float().cpu(), topk_ids.long().cpu(), topk_weights.cpu()
    gu_bias = None if experts.gate_up_bias is None else experts.gate_up_bias.float().cpu()
    d_bias = None if experts.down_bias is None else experts.down_bias.float().cpu()
    out = torch.zeros(x.shape[0], H)
    for e in range(E):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        h = x[tokens] @ gate_up[e].T + (0 if gu_bias is None else gu_bias[e])
        gate, up = h[:, :INTER], h[:, INTER:]
        if activation == "silu":
            act = F.silu(gate) * up
        else:
            gate = gate.clamp(max=CLAMPED_SWIGLU_LIMIT)
            up = up.clamp(-CLAMPED_SWIGLU_LIMIT, CLAMPED_SWIGLU_LIMIT)
            act = (up + 1) * gate * torch.sigmoid(CLAMPED_SWIGLU_ALPHA * gate)
        y = act @ down[e].T + (0 if d_bias is None else d_bias[e])
        out.index_add_(0, tokens, weights[tokens, slots, None] * y)
    return out


def routing(t: int, k: int, case: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if case == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    elif case == "two_experts":  # the other E - 2 experts get no token
        ids = torch.tensor([1, 5])[torch.stack([torch.randperm(2, generator=g) for _ in range(t)])][:, :k]
    else:  # "one_expert_all": expert 3 in every token's k
        others = torch.stack([torch.tensor([e for e in torch.randperm(E, generator=g).tolist() if e != 3])
                              for _ in range(t)])  # fmt: skip
        ids = torch.cat([torch.full((t, 1), 3), others[:, : k - 1]], dim=1)
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=1)
    return ids.to(torch.int32).to(CUDA), weights.to(CUDA)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want).norm() / want.norm())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_block", "mxfp4"])
def test_fused_moe_matches_float32_reference(fmt: Format, activation: str, bias: bool) -> None:
    experts, gate_up, down = make_experts(fmt, bias)
    # T=1; T=37 and 300 not multiples of any block; 700 and 2500 take the 64- and 128-row tiles
    for t, k, case in ((1, 2, "random"), (37, 2, "random"), (37, 2, "two_experts"), (37, 3, "one_expert_all"),
                       (300, 4, "random"), (700, 2, "random"), (2500, 2, "one_expert_all")):  # fmt: skip
        x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).to(CUDA)
        ids, weights = routing(t, k, case)
        got = fused_moe(x, experts, ids, weights, activation)  # type: ignore[arg-type]
        want = reference(x, experts, gate_up, down, ids, weights, activation)
        assert got.shape == (t, H) and got.dtype == torch.bfloat16
        assert torch.isfinite(got).all(), f"T={t} {case}: non-finite output"
        err = rel_l2(got, want)
        assert err < BOUND, f"T={t} k={k} {case} tile {tile_for(t, fmt)}: relative L2 {err:.2e}"


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_every_tile_in_the_table_gives_the_same_result(fmt: str) -> None:
    """Tuning may hand any T any tile: each of the table's, and a narrow one, computes the same layer."""
    experts, gate_up, down = make_experts(fmt, bias=True)
    x = torch.randn(45, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(CUDA)
    ids, weights = routing(45, 4, "random")
    want = reference(x, experts, gate_up, down, ids, weights, "silu")
    table, narrow = (MXFP4_TILES, Tile(16, 32, 128, 4, 2)) if fmt == "mxfp4" else (TILES, Tile(16, 32, 32, 4, 2))
    for tile in [tile for _, tile in table] + [narrow]:
        err = rel_l2(fused_moe(x, experts, ids, weights, tile=tile), want)
        assert err < BOUND, f"tile {tile}: relative L2 {err:.2e}"


def test_fused_moe_replays_in_a_cuda_graph_with_new_routing() -> None:
    """The align step reads no device value on the host: captured once, the graph computes
    the layer for whatever routing its input buffers hold at replay."""
    experts, gate_up, down = make_experts("bf16", bias=False)
    t, k = 24, 2
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(CUDA)
    ids, weights = routing(t, k, "random", seed=1)
    fused_moe(x, experts, ids, weights)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, experts, ids, weights)
    for seed, case in ((2, "random"), (3, "two_experts"), (4, "one_expert_all")):
        new_ids, new_weights = routing(t, k, case, seed=seed)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        want = fused_moe(x, experts, ids, weights)
        assert torch.equal(out, want), f"{case}: the replay differs from the eager call"
        assert rel_l2(out, reference(x, experts, gate_up, down, ids, weights, "silu")) < BOUND


def test_gpt_oss_interleaved_gate_up_is_reordered() -> None:
    """gpt-oss ships gate_up's rows interleaved (gate, up, ...): loaded with
    gate_up_interleaved, the layer equals one whose rows were ordered gate-first."""
    g = torch.Generator().manual_seed(7)
    gu_blocks = torch.randint(0, 256, (E, 2 * INTER, H // 32, 16), dtype=torch.uint8, generator=g)
    gu_scales = torch.randint(120, 124, (E, 2 * INTER, H // 32), dtype=torch.uint8, generator=g)
    d_blocks = torch.randint(0, 256, (E, H, INTER // 32, 16), dtype=torch.uint8, generator=g)
    d_scales = torch.randint(120, 124, (E, H, INTER // 32), dtype=torch.uint8, generator=g)
    gu_bias = torch.randn(E, 2 * INTER, generator=g)
    order = torch.cat([torch.arange(0, 2 * INTER, 2), torch.arange(1, 2 * INTER, 2)])
    gu_b, gu_s, d_b, d_s, bias = (a.to(CUDA) for a in (gu_blocks, gu_scales, d_blocks, d_scales, gu_bias))
    interleaved = experts_from_mxfp4(gu_b, gu_s, d_b, d_s, bias, gate_up_interleaved=True)
    ordered = experts_from_mxfp4(gu_b[:, order], gu_s[:, order], d_b, d_s, bias[:, order])
    x = torch.randn(9, H, generator=g).to(torch.bfloat16).to(CUDA)
    ids, weights = routing(9, 2, "random")
    got = fused_moe(x, interleaved, ids, weights, "swiglu_clamped")
    assert torch.equal(got, fused_moe(x, ordered, ids, weights, "swiglu_clamped"))
    gate_up = torch.from_numpy(mxfp4.dequantize(gu_blocks.numpy(), gu_scales.numpy()))[:, order]
    down = torch.from_numpy(mxfp4.dequantize(d_blocks.numpy(), d_scales.numpy()))
    assert rel_l2(got, reference(x, ordered, gate_up, down, ids, weights, "swiglu_clamped")) < BOUND


def test_an_empty_batch_gives_an_empty_output() -> None:
    experts, _, _ = make_experts("bf16", bias=False)
    x = torch.empty(0, H, dtype=torch.bfloat16, device=CUDA)
    out = fused_moe(x, experts, torch.empty(0, 2, dtype=torch.int32, device=CUDA),
                    torch.empty(0, 2, device=CUDA))  # fmt: skip
    assert out.shape == (0, H)
