"""The bench's roofline of an offline workload under each capacity scheduler policy."""

from __future__ import annotations

import pytest

from bench.model_shapes import LLAMA_8B
from bench.roofline import Roofline, roofline_for
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
