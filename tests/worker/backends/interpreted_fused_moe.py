"""The fused MoE kernel (worker/backends/fused_moe.py) run by Triton's interpreter on the
CPU, on a layer small enough for seconds, against a float32 reference: every format, both
activations, with biases, at T=1 and T=5 (neither a multiple of the 16-row block), with
experts that get no token; and a layer's experts split in two halves as expert-parallel
ranks hold them, each half's output counting only its own experts' pairs. Run with
TRITON_INTERPRET=1 set before Triton is imported (test_fused_moe_interpreted.py starts this
module in a process of its own).

    TRITON_INTERPRET=1 python -m tests.worker.backends.interpreted_fused_moe

Also a gpt-oss MXFP4 checkpoint's layers as the CUDA backend builds them from the packed
bytes, against the loop over its float twin.

Tolerance: the weights reach tl.dot exactly (bf16, e4m3 and e2m1 values), the products
accumulate in float32; the activation and the output are rounded to bf16 (2^-9 relative
each): ~3e-3 in relative L2; bound 1e-2.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from worker.backends.fused_moe import (
    ACTIVATIONS,
    ExpertWeights,
    Tile,
    _align,
    align_capacity,
    dequantize_expert,
    experts_from_float,
    experts_from_mxfp4,
    fused_moe,
)
from worker.models import mxfp4

# H not a multiple of BLOCK_K (the last K step masked) nor of BLOCK_N (the last columns masked)
E, H, INTER = 4, 96, 64
TILE = Tile(16, 64, 128, 4, 1)


def make_experts(fmt: str) -> ExpertWeights:
    gu_bias, d_bias = torch.randn(E, 2 * INTER), torch.randn(E, H).to(torch.bfloat16)
    if fmt == "mxfp4":
        gu_blocks = torch.randint(0, 256, (E, 2 * INTER, H // 32, 16), dtype=torch.uint8)
        d_blocks = torch.randint(0, 256, (E, H, INTER // 32, 16), dtype=torch.uint8)
        gu_scales = torch.randint(121, 125, (E, 2 * INTER, H // 32), dtype=torch.uint8)
        d_scales = torch.randint(121, 125, (E, H, INTER // 32), dtype=torch.uint8)
        experts = experts_from_mxfp4(gu_blocks, gu_scales, d_blocks, d_scales, gu_bias, d_bias)
        # the kernel's reference dequantization is the format's definition, exactly
        assert torch.equal(dequantize_expert(experts, 2)[0],
                           torch.from_numpy(mxfp4.dequantize(gu_blocks[2].numpy(), gu_scales[2].numpy())))  # fmt: skip
        return experts
    w_gu, w_d = torch.randn(E, 2 * INTER, H) / H**0.5, torch.randn(E, H, INTER) / INTER**0.5
    return experts_from_float(w_gu, w_d, gu_bias, d_bias, format=fmt)  # type: ignore[arg-type]


def reference(x: torch.Tensor, experts: ExpertWeights, ids: torch.Tensor, weights: torch.Tensor,
              activation: str) -> torch.Tensor:  # fmt: skip
    """float32, token by token and expert by expert."""
    assert experts.gate_up_bias is not None and experts.down_bias is not None
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up, down = dequantize_expert(experts, e)
            h = gate_up @ x[t].float() + experts.gate_up_bias[e].float()
            gate, up = h[:INTER], h[INTER:]
            if activation == "silu":
                act = F.silu(gate) * up
            else:
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            out[t] += weights[t, j] * (down @ act + experts.down_bias[e].float())
    return out


def check_align() -> None:
    """The sort by expert puts every (token, slot) pair once in a block of its expert's, pads
    with the sentinel T * k, and marks the blocks past the used ones -1; under expert
    parallelism, the pairs of other ranks' experts sit in blocks marked -1."""
    cases = ((1, 8, 128, 16, None), (37, 2, 8, 16, None), (300, 4, 32, 64, None), (64, 8, 128, 32, None),
             (37, 2, 8, 16, 2))  # fmt: skip
    for t, k, e, block, start in cases:
        g = torch.Generator().manual_seed(t)
        # experts 0 .. e/2 only: the others get no pair
        ids = torch.stack([torch.randperm(e // 2, generator=g)[:k] for _ in range(t)]).to(torch.int32)
        held = e if start is None else e - start
        sorted_pairs, block_expert = _align(ids, held, block, start)
        case = f"T={t} k={k} E={e} block={block} start={start}"
        assert sorted_pairs.numel() == align_capacity(t * k, held + (start is not None), block), case
        assert sorted_pairs.numel() == block_expert.numel() * block, case
        assert (sorted_pairs[sorted_pairs >= t * k] == t * k).all(), f"{case}: padding holds the sentinel T * k"
        flat = ids.reshape(-1).long()
        mine = flat >= (start or 0)
        blocks = sorted_pairs.view(-1, block)
        run = blocks[block_expert >= 0]
        assert sorted(run[run < t * k].tolist()) == mine.nonzero().flatten().tolist(), f"{case}: each pair once"
        real = sorted_pairs[sorted_pairs < t * k]
        assert sorted(real.tolist()) == list(range(t * k)), f"{case}: each pair filed once"
        for b, expert in enumerate(block_expert.tolist()):
            pairs = blocks[b][blocks[b] < t * k].long()
            if expert >= 0:
                assert pairs.numel() > 0 and (flat[pairs] == expert + (start or 0)).all(), f"{case}: block {b}"
            elif start is None:
                assert pairs.numel() == 0, f"{case}: block {b} holds pairs but no expert"
        used = block_expert[block_expert >= 0]
        assert torch.equal(used, used.sort().values), case
        assert set(used.tolist()) == set((flat[mine] - (start or 0)).tolist()), case


def check_fused_moe() -> None:
    # T=1; T=5 over experts 0, 1, 3 only (expert 2 gets no token)
    routings = (torch.tensor([[2, 0]]), torch.tensor([[0, 1], [1, 3], [3, 0], [1, 0], [0, 3]]))
    for fmt in ("bf16", "fp8", "fp8_block", "mxfp4"):
        experts = make_experts(fmt)
        for ids in routings:
            x = torch.randn(ids.shape[0], H).to(torch.bfloat16)
            weights = torch.softmax(torch.randn(ids.shape), dim=1)
            for activation in ACTIVATIONS:
                got = fused_moe(x, experts, ids.to(torch.int32), weights, activation, tile=TILE)
                want = reference(x, experts, ids, weights, activation)
                err = float((got.float() - want).norm() / want.norm())
                assert got.dtype == torch.bfloat16 and err < 1e-2, f"{fmt} {activation} T={ids.shape[0]}: {err:.2e}"


def check_gpt_oss_packed_layers() -> None:
    """A gpt-oss MXFP4 checkpoint's layers as the CUDA backend builds them (the packed bytes,
    gate rows then up rows: torch_moe.mxfp4_experts) against the expert loop over its float
    twin's weights, routed alike: the same bound."""
    import tempfile
    from pathlib import Path

    from tests.worker.models.mxfp4_checkpoints import mxfp4_and_float_twins
    from worker.backends.torch_decoder_ops import TorchDecoderOps
    from worker.backends.torch_moe import mxfp4_experts, route, run_experts
    from worker.models.loader import load_model
    from worker.models.moe_checkpoint import expert_tensors
    from worker.models.mxfp4 import Mxfp4Tensor

    with tempfile.TemporaryDirectory() as tmp:
        packed_dir, exact_dir = mxfp4_and_float_twins(Path(tmp))
        packed, exact = load_model(packed_dir), load_model(exact_dir)  # the experts are read from here
        cfg = packed.config
        ops = TorchDecoderOps(cfg, torch.device("cpu"), torch.float32, 64)
        for layer in cfg.moe_layers:
            tensors = expert_tensors(cfg, {**packed.weights, **packed.mxfp4_experts}.__getitem__, layer)
            assert isinstance(tensors.gate, Mxfp4Tensor) and isinstance(tensors.up, Mxfp4Tensor)
            assert isinstance(tensors.down, Mxfp4Tensor)
            bias = torch.cat([torch.as_tensor(tensors.gate_bias), torch.as_tensor(tensors.up_bias)], dim=1)
            fused = mxfp4_experts(tensors.gate, tensors.up, tensors.down, bias, torch.as_tensor(tensors.down_bias),
                                  torch.device("cpu"))  # fmt: skip
            assert fused.format == "mxfp4"
            floats = ops.expert_weights(expert_tensors(cfg, exact.weights.__getitem__, layer))
            x = torch.randn(5, cfg.hidden_size).to(torch.bfloat16)
            chosen, weights = route(F.linear(x.float(), floats.router, floats.router_bias), cfg)
            want = run_experts(x.float(), floats, chosen, weights, cfg.expert_act)
            got = fused_moe(x, fused, chosen.to(torch.int32), weights, cfg.expert_act, tile=TILE)  # type: ignore[arg-type]
            err = float((got.float() - want).norm() / want.norm())
            assert err < 1e-2, f"gpt-oss layer {layer}: {err:.2e}"


def _half(experts: ExpertWeights, start: int) -> ExpertWeights:
    """Experts start .. start + E / 2 - 1, as an expert-parallel rank stacks them."""
    cut = slice(start, start + E // 2)

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[cut].contiguous()

    return ExpertWeights(experts.format, experts.gate_up[cut].contiguous(), experts.down[cut].contiguous(),
                         rows(experts.gate_up_scale), rows(experts.down_scale), rows(experts.gate_up_bias),
                         rows(experts.down_bias))  # fmt: skip


def check_expert_parallel_halves() -> None:
    """Each half's output is the reference over the pairs routed to its experts (the others
    weighted 0); T=5 routes to both halves, T=1 to the second half only."""
    routings = (torch.tensor([[2, 3]]), torch.tensor([[0, 1], [1, 3], [3, 0], [1, 0], [0, 2]]))
    for fmt in ("bf16", "mxfp4"):
        experts = make_experts(fmt)
        for ids in routings:
            x = torch.randn(ids.shape[0], H).to(torch.bfloat16)
            weights = torch.softmax(torch.randn(ids.shape), dim=1)
            for start in (0, E // 2):
                mine = (ids >= start) & (ids < start + E // 2)
                got = fused_moe(x, _half(experts, start), ids.to(torch.int32), weights, "silu", tile=TILE,
                                expert_start=start)  # fmt: skip
                want = reference(x, experts, ids, weights * mine, "silu")
                if not mine.any():
                    assert not got.any(), f"{fmt} T={ids.shape[0]} half {start}: pairs of the other half computed"
                    continue
                err = float((got.float() - want).norm() / want.norm())
                assert err < 1e-2, f"{fmt} T={ids.shape[0]} half {start}: {err:.2e}"


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: the kernels must run in Triton's interpreter", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    check_align()
    print("check_align: ok", flush=True)
    check_fused_moe()
    print("check_fused_moe: ok", flush=True)
    check_gpt_oss_packed_layers()
    print("check_gpt_oss_packed_layers: ok", flush=True)
    check_expert_parallel_halves()
    print("check_expert_parallel_halves: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
