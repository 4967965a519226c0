"""Mixtures of experts on CUDA in bf16, through the fused expert kernel
(worker/backends/fused_moe.py) as the backend wires it: each family's MoE layers compute
what the expert loop computes, decode steps run in CUDA graphs and give what eager steps
give, and FP8 experts (quantized on load) compute with their e4m3 values. (The float32 path,
the loop, is held to transformers in tests/gpu/test_families_gpu.py.)"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.worker.backends.greedy_driver import greedy_run
from worker.backends.fused_moe import dequantize_expert
from worker.backends.torch_backend import TorchBackend
from worker.backends.torch_moe import experts_out, route, run_experts
from worker.models.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FAMILIES = ["mixtral_top2_window", "qwen3_moe_top4_dense_layer", "gpt_oss_sinks"]


@pytest.mark.parametrize("name", FAMILIES)
def test_each_moe_layer_the_kernel_computes_is_the_loops(name: str, tmp_path: Path) -> None:
    """The fused kernel against the expert loop on the layers as the backend built them
    (stacked weights, biases, the family's activation), the same routing: relative L2 within
    the kernel's bound (two bf16 roundings, of the activation and of the output: 1e-2)."""
    directory = make_checkpoint(name, tmp_path / name)
    backend = TorchBackend(load_model(directory), device="cuda", dtype="bfloat16", max_model_len=64,
                           use_cuda_graphs=False)  # fmt: skip
    layers = [layer.experts for layer in backend.model.layers if layer.experts is not None]
    assert layers and all(e.fused is not None for e in layers)
    cfg = backend.model.config
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    for experts in layers:
        chosen, weights = route(torch.nn.functional.linear(x, experts.router, experts.router_bias), cfg)
        fused = experts_out(x, experts, chosen, weights, cfg.expert_act).float()
        loop = run_experts(x, experts, chosen, weights, cfg.expert_act).float()
        assert float((fused - loop).norm() / loop.norm()) < 1e-2


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_decode_runs_in_cuda_graphs_as_eager(name: str, tmp_path: Path) -> None:
    directory = make_checkpoint(name, tmp_path / name)
    prompts = {s: np.random.default_rng(i).integers(3, 250, 9 + 7 * i).tolist() for i, s in enumerate("abcd")}
    results = []
    graphs = TorchBackend(load_model(directory), device="cuda", dtype="bfloat16", max_model_len=128)
    eager = TorchBackend(load_model(directory), device="cuda", dtype="bfloat16", max_model_len=128,
                         use_cuda_graphs=False)  # fmt: skip
    for backend in (graphs, eager):
        backend.allocate_kv_cache(num_blocks=128, block_size=16)
        results.append(greedy_run(backend, prompts, 16, seed=1, block_size=16, num_blocks=128, chunk=8))
    assert graphs._graphs is not None and graphs._graphs.graphs, "no decode step went through a CUDA graph"
    assert results[0] == results[1]


def test_fp8_experts_compute_their_dequantized_weights(tmp_path: Path) -> None:
    """--quantization fp8 stores the experts in e4m3 with a scale per output channel (no
    float copy kept), and the kernel computes with exactly those values: against the loop
    over the dequantized weights (held in bf16), within the kernel's bound (1e-2)."""
    directory = make_checkpoint("qwen3_moe_top4_dense_layer", tmp_path / "q")
    fp8 = TorchBackend(load_model(directory), device="cuda", dtype="bfloat16", max_model_len=64, use_cuda_graphs=False,
                       quantization="fp8")  # fmt: skip
    layers = [layer.experts for layer in fp8.model.layers if layer.experts is not None]
    assert layers and all(e.fused is not None and e.fused.format == "fp8" and e.gate_up is None for e in layers)
    cfg = fp8.model.config
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    for experts in layers:
        assert experts.fused is not None
        parts = [dequantize_expert(experts.fused, e) for e in range(cfg.num_experts)]
        as_float = replace(experts, gate_up=torch.stack([p[0] for p in parts]).to(torch.bfloat16),
                           down=torch.stack([p[1] for p in parts]).to(torch.bfloat16), fused=None)  # fmt: skip
        chosen, weights = route(torch.nn.functional.linear(x, experts.router, experts.router_bias), cfg)
        fused = experts_out(x, experts, chosen, weights, cfg.expert_act).float()
        loop = run_experts(x, as_float, chosen, weights, cfg.expert_act).float()
        assert float((fused - loop).norm() / loop.norm()) < 1e-2
