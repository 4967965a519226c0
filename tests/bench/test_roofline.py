"""The bench's roofline of an offline workload under each capacity scheduler policy."""

from __future__ import annotations

import pytest

from bench.model_shapes import GEMMA3_12B, LLAMA_8B, SHAPES
from bench.roofline import Roofline, roofline_for, roofline_of
from worker.models.config import ModelConfig


def one_second_steps() -> Roofline:
    """Every step reads the weights in exactly one second and nothing else costs anything."""
    return Roofline(bandwidth=1.0, flops=1e30, weight_bytes=1, matmul_params=1, lm_head_params=1,
                    kv_bytes_per_token=0, attn_flops_per_ctx=1)  # fmt: skip


def test_each_policy_counts_its_own_steps() -> None:
    # 2 requests of 1 + 3 tokens on a 4-token cache. Guaranteed: one at a time (4 tokens each),
    # a prefill step and 2 decode steps each: 5 s. Max utilization: both start; after the second
    # step they need 6 slots, so the newer is dropped, the older finishes, and the newer is
    # recomputed (3 tokens) in a fourth step whose sample is its last token: 4 s.
    roof = one_second_steps()
    assert roof.for_schedule(1, 3, 2, 2, 4, "guaranteed_no_evict") == pytest.approx(6 / 5)
    assert roof.for_schedule(1, 3, 2, 2, 4, "max_utilization") == pytest.approx(6 / 4)


def test_without_preemption_both_schedules_agree() -> None:
    # 1,024 requests of 128/128 fit the cache at full length: the step-by-step schedule and
    # the waves model differ only in how the prefill is split over steps.
    roof = roofline_for(ModelConfig.from_hf(LLAMA_8B), 3.0e12, 800e12, 2)
    waves = roof.for_schedule(128, 128, 1024, 512, 430_720, "guaranteed_no_evict")
    steps = roof.for_schedule(128, 128, 1024, 512, 430_720, "max_utilization")
    assert steps == pytest.approx(waves, rel=0.01)


def test_max_utilization_runs_more_at_once_on_long_outputs() -> None:
    # bf16 1000/1000 on an H100's cache (215 requests at full length, all 256 at their start)
    roof = roofline_for(ModelConfig.from_hf(LLAMA_8B), 3.0e12, 800e12, 2)
    guaranteed = roof.for_schedule(1000, 1000, 256, 512, 430_720, "guaranteed_no_evict")
    assert roof.for_schedule(1000, 1000, 256, 512, 430_720, "max_utilization") > 1.05 * guaranteed


def test_a_request_the_cache_cannot_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="a request's 8 tokens do not fit a 6-token cache"):
        one_second_steps().for_schedule(8, 4, 2, 2, 6, "max_utilization")


def test_the_sustained_roofline_is_the_same_model_at_the_held_rate() -> None:
    # 128/128 at batch 512 is compute-bound: a lower held GEMM rate lowers it; batch 1 reads
    # the weights and is not; unmeasured, there is no sustained roofline
    roof = roofline_for(ModelConfig.from_hf(LLAMA_8B), 3.0e12, 800e12, 2)
    assert roof.at_sustained() is None
    roof.sustained_flops = 600e12
    held = roof.at_sustained()
    assert held is not None and held.flops == 600e12 and roof.flops == 800e12
    burst = roof.for_schedule(128, 128, 1024, 512, 430_720, "guaranteed_no_evict")
    assert held.for_schedule(128, 128, 1024, 512, 430_720, "guaranteed_no_evict") < 0.85 * burst
    assert held.for_schedule(128, 128, 1, 1, 430_720, "guaranteed_no_evict") == pytest.approx(
        roof.for_schedule(128, 128, 1, 1, 430_720, "guaranteed_no_evict"), rel=1e-3)


def test_a_sustained_rate_times_only_the_second_half_of_its_run() -> None:
    # a product that slows to a quarter of its speed after 0.2 s, as a GPU does at its power cap
    import time

    import torch

    from bench.device_rates import product_rate

    started = time.perf_counter()

    def product() -> None:
        time.sleep(0.001 if time.perf_counter() - started < 0.2 else 0.004)

    burst = product_rate(product, 1.0, torch.device("cpu"))
    sustained = product_rate(product, 1.0, torch.device("cpu"), sustained_s=0.8)
    assert sustained < 0.6 * burst


def test_llama_8b_figures_stay_as_they_were() -> None:
    # Figures of the roofline before the family shapes joined it, at fixed H100-like ceilings:
    # a model without sliding windows must count exactly what it counted.
    cfg = ModelConfig.from_hf(LLAMA_8B)
    cases = [((None, 3.35e12, 989e12, None), (15009316864, 131072, 0.004519519063880597, 9264.469151685646,
                                               9970.788859611663, 0.05834913855365824)),
             (("fp8", 3.35e12, 1979e12, "fp8"), (8035500032, 65536, 0.002418219711044776, 18115.045458849527,
                                                 19624.87654633376, 0.029159827200388073)),
             (("int4", 3.35e12, 989e12, None), (6285164544, 131072, 0.0019152944907462686, 11413.687065623742,
                                                11505.388237877754, 0.05834913855365824))]  # fmt: skip
    for (quantization, bandwidth, flops, kv), want in cases:
        roof = roofline_of(cfg, quantization, 2, bandwidth, flops, kv_cache_dtype=kv)
        assert roof.window is None
        got = (roof.weight_bytes, roof.kv_bytes_per_token, roof.decode_floor(1000),
               roof.offline_tok_s(1000, 1000, 256, 215), roof.max_utilization_tok_s(1000, 1000, 256, 512, 430_720),
               roof.step_floor(4096, 8, 1e6, 2e5))  # fmt: skip
        assert got == want


@pytest.mark.parametrize("shape", ["qwen3-8b", "gemma3-12b"])
def test_family_shapes_count_the_parameters_transformers_builds(shape: str) -> None:
    # transformers' model of the config, on the meta device: its projection and head parameters
    # are what every step reads (a tied head reads the embedding).
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(SHAPES[shape])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    roof = roofline_for(ModelConfig.from_hf(hf), 1.0, 1.0, 2)
    assert roof.matmul_params + roof.lm_head_params == linear
    assert roof.weight_bytes == 2 * linear


def test_gemma3_sliding_layers_read_only_the_window_at_decode() -> None:
    # Gemma-3-12B: 40 of 48 layers slide over 1024 tokens; a KV token is 2 x 8 heads x 256 x 2 bytes a layer.
    roof = roofline_for(ModelConfig.from_hf(GEMMA3_12B), 1.0, 1e30, 2)
    per_layer = 2 * 8 * 256 * 2
    assert roof.decode_floor(500) == roof.weight_bytes + 48 * per_layer * 500
    assert roof.decode_floor(8192) == roof.weight_bytes + 8 * per_layer * 8192 + 40 * per_layer * 1024
    # one step of 4 sequences at 8192 tokens each reads the same KV as 4 alone
    assert roof.step_floor(4, 4, 4 * 8192, 4 * 8192, 4 * 1024, 4 * 1024) == (
        roof.weight_bytes + 4 * (8 * per_layer * 8192 + 40 * per_layer * 1024)
    )
    # the offline floor of long sequences beats the same model with every layer global
    every_layer_global = roofline_for(ModelConfig.from_hf({**GEMMA3_12B, "sliding_window": None}), 1.0, 1e30, 2)
    assert roof.offline_tok_s(2048, 64, 8, 8) > every_layer_global.offline_tok_s(2048, 64, 8, 8)


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b"])
def test_moe_shapes_count_the_parameters_transformers_builds(shape: str) -> None:
    # transformers' model on the meta device: the linear layers (attention, routers, head) every
    # step reads, and the experts' stacked parameters, k of E of which a token computes.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(SHAPES[shape])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # transformers' routers are modules of their own, not Linear
    routers = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("mlp.gate.weight", "router.weight")))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and "bias" not in n)
    roof = roofline_for(ModelConfig.from_hf(hf), 1.0, 1.0, 2)
    assert routers > 0
    assert roof.matmul_params + roof.lm_head_params == linear + routers
    assert roof.expert_params * roof.experts == experts
    assert roof.weight_bytes == 2 * (linear + routers) and roof.expert_bytes == 2 * roof.expert_params


def test_a_moe_step_reads_the_experts_its_tokens_chose() -> None:
    roof = roofline_for(ModelConfig.from_hf(SHAPES["qwen3-30b-a3b"]), 1.0, 1e30, 2)
    assert (roof.experts, roof.experts_per_token) == (128, 8)
    assert roof.experts_read(1) == pytest.approx(8)  # one token: its own k
    assert roof.experts_read(4096) == pytest.approx(128)  # a large batch: all of them
    assert 8 < roof.experts_read(16) < 16 * 8  # some chosen twice
    assert roof.decode_floor(0) == pytest.approx(roof.weight_bytes + 8 * roof.expert_bytes)


def test_mxfp4_experts_are_counted_packed_and_gpt_oss_120b_fits_one_gpu() -> None:
    # A packed weight: half a byte, and one scale byte per block of 32.
    cfg = ModelConfig.from_hf(SHAPES["gpt-oss-120b"])
    bf16 = roofline_of(cfg, None, 2, 1.0, 1e30)
    mxfp4 = roofline_of(cfg, None, 2, 1.0, 1e30, expert_dtype="mxfp4")
    assert mxfp4.expert_bytes == bf16.expert_params * 17 // 32 and mxfp4.weight_bytes == bf16.weight_bytes
    # 36 layers x 128 experts x 3 x 2880^2 weights: 229 GB in bf16, 61 GB packed (+ 4 GB of the rest in bf16)
    assert mxfp4.expert_params * mxfp4.experts == 36 * 128 * 3 * 2880 * 2880
    assert bf16.expert_bytes * bf16.experts > 141e9 > mxfp4.expert_bytes * mxfp4.experts + mxfp4.weight_bytes
    # a batch-1 step reads its 4 experts' packed bytes
    assert mxfp4.decode_floor(0) == pytest.approx(mxfp4.weight_bytes + 4 * mxfp4.expert_bytes)
