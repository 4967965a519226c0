"""Programmatic dependent launch (worker/backends/pdl.py, one-row steps) on a Hopper GPU: a batch-1
chain of our kernels (add + RMSNorm, the gate_up GEMV with SwiGLU in it or apart, SiLU *
up, the down GEMV, eight layers deep) captured
in a CUDA graph with PDL gives, over many replays with fresh inputs, bit for bit what
the same chain gives launched plainly: a kernel that read its input before its
predecessor finished writing it would show here as a mismatch."""

from __future__ import annotations

import pytest
import torch

from worker.backends import gemv, pdl, torch_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
HIDDEN, INTER, LAYERS = 2048, 5632, 8


def _chain(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    residual = torch.zeros_like(x)
    for i, (norm, gate_up, down) in enumerate(weights):
        h = torch_ops.add_rmsnorm_triton(x, residual, norm, 1e-5)
        act = torch_ops.silu_mul_triton(gemv.gemv(h, gate_up)) if i % 2 else gemv.gemv_swiglu(h, gate_up)
        x = gemv.gemv(act, down)
    return torch_ops.add_rmsnorm_triton(x, residual, weights[0][0], 1e-5)


def test_a_graph_of_pdl_launches_equals_plain_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cuda")
    if not pdl.options(device, 1)["PDL"]:
        pytest.skip("PDL needs compute capability 9.0 and Triton's gdc ops")
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    weights = [(1 + randn(HIDDEN, scale=0.1), randn(2 * INTER, HIDDEN, scale=0.02), randn(HIDDEN, INTER, scale=0.02))
               for _ in range(LAYERS)]  # fmt: skip
    inputs = [randn(1, HIDDEN) for _ in range(50)]
    monkeypatch.setattr(pdl, "enabled", False)
    want = [_chain(x, weights) for x in inputs]
    monkeypatch.setattr(pdl, "enabled", True)
    static = inputs[0].clone()
    _chain(static, weights)  # compiles the PDL variants off the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(static, weights)
    for x, expected in zip(inputs, want, strict=True):
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
