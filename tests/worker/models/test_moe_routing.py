"""Routing, as each family's transformers router computes it: softmax then top-k,
renormalised (Mixtral) or not (Qwen3-MoE without norm_topk_prob); top-k of biased logits
then softmax (gpt-oss). The numpy definition and the torch backend's agree with it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from worker.backends import torch_moe
from worker.models.config import ModelConfig
from worker.models.moe_routing import route

BASE = ModelConfig("mixtral", 320, 64, 128, 1, 4, 2, 16, 1e-5, 1e4, 512, False, False, num_experts=8)


def _router(kind: str, k: int, norm: bool) -> tuple[Any, ModelConfig]:
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    shape: dict[str, Any] = {"hidden_size": 64, "num_experts_per_tok": k}
    if kind == "mixtral":
        mixtral = transformers.MixtralConfig(num_local_experts=8, **shape)
        return MixtralTopKRouter(mixtral), replace(BASE, experts_per_token=k, norm_topk_prob=True)
    if kind == "qwen3_moe":
        qwen = transformers.Qwen3MoeConfig(num_experts=8, norm_topk_prob=norm, **shape)
        return Qwen3MoeTopKRouter(qwen), replace(BASE, experts_per_token=k, norm_topk_prob=norm)
    gpt_oss = transformers.GptOssConfig(num_local_experts=8, **shape)
    return GptOssTopKRouter(gpt_oss), replace(BASE, experts_per_token=k, router="topk_softmax")


@pytest.mark.parametrize(("kind", "k", "norm"), [("mixtral", 2, True), ("qwen3_moe", 4, True),
                                                 ("qwen3_moe", 1, False), ("gpt_oss", 4, False)])  # fmt: skip
def test_routing_matches_transformers_routers(kind: str, k: int, norm: bool) -> None:
    torch.manual_seed(0)
    router, config = _router(kind, k, norm)
    with torch.no_grad():
        for param in router.parameters():
            param.normal_(0.0, 0.5)
        x = torch.randn(40, 64)
        _, want_weights, want_experts = router(x)
        logits = torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None))
    order = want_experts.argsort(dim=-1)  # the sum over experts does not depend on their order
    want_experts, want_weights = want_experts.gather(1, order).numpy(), want_weights.gather(1, order).numpy()
    for experts, weights in (route(logits.numpy(), config), torch_moe.route(logits, config)):
        experts, weights = np.asarray(experts), np.asarray(weights)
        order_got = experts.argsort(axis=-1)
        np.testing.assert_array_equal(np.take_along_axis(experts, order_got, -1), want_experts)
        np.testing.assert_allclose(np.take_along_axis(weights, order_got, -1), want_weights, rtol=1e-6, atol=1e-7)
        assert weights.dtype == np.float32
