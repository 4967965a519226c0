"""The experts' activations against transformers' own: gpt-oss's clamped SwiGLU over
values past its clamps on both sides (transformers interleaves gate and up; here they
are halves), and SiLU * up; numpy and the torch backend's alike."""

from __future__ import annotations

import numpy as np
import torch

from worker.backends import torch_moe
from worker.models.expert_act import expert_act


def test_clamped_swiglu_matches_gpt_oss_experts() -> None:
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(transformers.GptOssConfig(hidden_size=8, intermediate_size=16, num_local_experts=1))
    gate_up = torch.linspace(-20.0, 20.0, 7 * 32).reshape(7, 32)
    gate_up = gate_up[:, torch.randperm(32, generator=torch.Generator().manual_seed(0))]
    interleaved = torch.stack([gate_up[:, :16], gate_up[:, 16:]], dim=-1).reshape(7, 32)
    want = experts._apply_gate(interleaved).numpy()
    assert (gate_up[:, :16] > 7).any() and (gate_up[:, 16:] < -7).any()  # both clamps bite
    np.testing.assert_allclose(expert_act(gate_up.numpy(), "swiglu_clamped"), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(torch_moe.expert_act(gate_up, "swiglu_clamped").numpy(), want, rtol=1e-6, atol=1e-6)


def test_silu_times_up() -> None:
    gate_up = torch.randn(5, 12, generator=torch.Generator().manual_seed(1)) * 4
    want = (torch.nn.functional.silu(gate_up[:, :6]) * gate_up[:, 6:]).numpy()
    np.testing.assert_allclose(expert_act(gate_up.numpy(), "silu"), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(torch_moe.expert_act(gate_up, "silu").numpy(), want, rtol=1e-6, atol=1e-6)
