"""The serving benchmark's harness on a tiny checkpoint in process (numpy backend):
Poisson send times at the asked rate, and every request's tokens, TTFT and E2E counted."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from bench.serving_bench import (
    WARM_UP,
    RateRun,
    _in_process_at,
    arrivals,
    executor_config,
    parser,
    prompts_for,
    run_in_process,
    sweep,
    variant,
)
from tests.checkpoints import VOCAB_SIZE, make_checkpoint
from worker.executor import Executor, ExecutorConfig, KvCacheConfig


def test_arrivals_are_a_poisson_process_at_the_rate() -> None:
    times = arrivals(20_000, 50.0, seed=1)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 1 / 50) < 0.001  # exponential gaps of mean 1 / rate
    assert abs(gaps.std() - 1 / 50) < 0.001
    assert (arrivals(5, math.inf, seed=1) == 0).all()  # a burst: all at once


def test_in_process_run_counts_every_request(tmp_path: Path) -> None:
    directory = make_checkpoint("llama_gqa", tmp_path / "llama_gqa")
    config = ExecutorConfig(backend="numpy", max_batch_size=8, kv_cache_config=KvCacheConfig(max_tokens=4096))
    n, prompt, output = 6, 12, 8
    with Executor.from_model(directory, config) as executor:
        run = run_in_process(executor, "tiny", prompts_for(n, prompt, VOCAB_SIZE, 0), output, rate=40.0, seed=3)
    assert run.requests == n and run.tokens == n * output
    assert len(run.ttft_ms) == n and len(run.e2e_ms) == n
    assert len(run.itl_ms) == n * (output - 1)
    assert all(e >= t for e, t in zip(sorted(run.e2e_ms), sorted(run.ttft_ms), strict=True))
    # Six sends at 40 / s span about 0.125 s: the run lasts at least until the last send.
    assert run.seconds >= float(arrivals(n, 40.0, seed=3)[-1])


def test_a_quantized_run_says_so_and_loads_the_model_quantized(tmp_path: Path) -> None:
    args = parser().parse_args(["--quantization", "int4", "--kv-cache-dtype", "fp8", "--kv-tokens", "4096"])
    config = executor_config(args)
    assert config.quantization == "int4" and config.kv_cache_config.dtype == "fp8"
    assert config.kv_cache_config.max_tokens == 4096
    assert variant(args) == " int4+fp8kv"
    assert variant(parser().parse_args([])) == ""
    assert variant(parser().parse_args(["--kv-cache-dtype", "fp8"])) == " +fp8kv"
    # The int4 config on the CPU's numpy backend (an e4m3 cache is the torch backend's, on CUDA).
    directory = make_checkpoint("llama_gqa", tmp_path / "llama_gqa")
    cpu = ExecutorConfig(backend="numpy", max_batch_size=8, kv_cache_config=KvCacheConfig(max_tokens=4096),
                         quantization=config.quantization)  # fmt: skip
    with Executor.from_model(directory, cpu) as executor:
        assert str(getattr(executor.core.backend, "quantization", "")).startswith("int4 (quantized on load")
        run = run_in_process(executor, "tiny", prompts_for(3, 12, VOCAB_SIZE, 0), 4, rate=math.inf, seed=1)
    assert run.requests == 3 and run.tokens == 3 * 4


def test_the_sweep_warms_up_unreported_first(tmp_path: Path) -> None:
    """A burst and a run at the lowest rate go first (Triton compiles on a variant's first
    launch) with prompts and arrivals of their own; only the burst and the rates are reported."""
    directory = make_checkpoint("llama_gqa", tmp_path / "llama_gqa")
    config = ExecutorConfig(backend="numpy", max_batch_size=8, kv_cache_config=KvCacheConfig(max_tokens=4096))
    calls: list[tuple[float, int]] = []
    with Executor.from_model(directory, config) as executor:

        def run(rate: float, i: int) -> RateRun:
            calls.append((rate, i))
            return run_in_process(executor, "tiny", prompts_for(4, 12, VOCAB_SIZE, 10 + i), 4, rate, seed=i)

        runs, rates = sweep(run, [30.0, 60.0], lambda line: None)
    assert calls == [(math.inf, WARM_UP), (30.0, WARM_UP + 1), (math.inf, 0), (30.0, 1), (60.0, 2)]
    assert rates == [30.0, 60.0]
    assert [r.rate for r in runs] == [math.inf, 30.0, 60.0]
    assert all(r.requests == 4 and r.tokens == 16 for r in runs)


def test_a_burst_reports_the_engine_steps_that_took_its_prompts(tmp_path: Path) -> None:
    """Six 12-token prompts at once through a 24-token step budget take at least three
    steps, all of them ended within the run, the first holding some of the six; a run at a
    rate reports none."""
    directory = make_checkpoint("llama_gqa", tmp_path / "llama_gqa")
    config = ExecutorConfig(backend="numpy", max_batch_size=8, max_num_tokens=24,
                            kv_cache_config=KvCacheConfig(max_tokens=4096))  # fmt: skip
    with Executor.from_model(directory, config) as executor:
        burst = _in_process_at(executor, "tiny", 6, 12, 4, VOCAB_SIZE, math.inf, 0)
        paced = _in_process_at(executor, "tiny", 6, 12, 4, VOCAB_SIZE, 40.0, 1)
    assert burst.prompts.steps >= 3
    assert 0 < burst.prompts.last_ms <= burst.seconds * 1e3
    assert 1 <= burst.prompts.first_held <= 6
    assert burst.row()[-1] == f"{burst.prompts.steps} / {burst.prompts.last_ms:.0f} / {burst.prompts.first_held}"
    assert paced.prompts.steps == 0 and paced.row()[-1] == "-"
