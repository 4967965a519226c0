"""The GPU bench's command line reaches the executor it builds and picks its rows and their
request counts (no GPU needed)."""

from __future__ import annotations

import pytest

from bench.gpu_bench import WORKLOADS, parse_args, parser
from bench.model_shapes import LLAMA_8B
from bench.offline_runs import row_plan
from bench.roofline import roofline_for
from bench.row_limits import BatchLimits
from bench.runner import executor_config
from bench.workloads import select_workloads
from worker.executor import CapacitySchedulerPolicy
from worker.models.config import ModelConfig


@pytest.mark.parametrize(("flag", "policy"), [([], CapacitySchedulerPolicy.GUARANTEED_NO_EVICT),
                                              (["--scheduler-policy", "max_utilization"],
                                               CapacitySchedulerPolicy.MAX_UTILIZATION)])  # fmt: skip
def test_scheduler_policy_reaches_the_executor(flag: list[str], policy: CapacitySchedulerPolicy) -> None:
    args = parser().parse_args(["--max-batch", "64", "--block-size", "16", *flag])
    config = executor_config(args, "fp8")
    assert config.scheduler_config.capacity_scheduler_policy is policy
    assert config.max_batch_size == 64
    assert config.kv_cache_config.tokens_per_block == 16 and config.kv_cache_config.dtype == "fp8"


def test_an_unknown_scheduler_policy_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--scheduler-policy", "static_batch"])
    assert "invalid choice: 'static_batch'" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "fraction"), [([], 0.9), (["--free-memory-fraction", "0.95"], 0.95)])
def test_free_memory_fraction_reaches_the_kv_cache_config(flag: list[str], fraction: float) -> None:
    config = executor_config(parser().parse_args(flag), None)
    assert config.kv_cache_config.free_memory_fraction == fraction


def test_published_runs_the_published_rows_under_the_published_limits() -> None:
    args = parse_args(["--quantization", "fp8", "--kv-cache-dtype", "fp8", "--published"])
    assert [f"{p}/{o}" for p, o, _, _ in select_workloads(WORKLOADS, args)] == [
        "128/128", "128/2048", "2048/128", "1000/1000", "2048/2048"]  # fmt: skip
    assert (args.free_memory_fraction, args.max_batch, args.max_num_tokens) == (0.95, 1024, 16384)
    # a limit given wins; --workloads narrows the published rows
    args = parse_args(["--quantization", "fp8", "--published", "--max-batch", "2048", "--workloads", "128/128"])
    assert args.max_batch == 2048 and args.free_memory_fraction == 0.95
    assert [w[:2] for w in select_workloads(WORKLOADS, args)] == [(128, 128)]
    args = parse_args(["--model-shape", "70b", "--tensor-parallel-size", "2", "--quantization", "fp8", "--published"])
    assert [f"{p}/{o}" for p, o, _, _ in select_workloads(WORKLOADS, args)] == ["128/128", "128/2048", "1000/1000"]


def test_published_without_published_rows_is_refused() -> None:
    args = parse_args(["--published"])
    with pytest.raises(ValueError, match="TensorRT-LLM published no rows for model shape 8b, quantization None"):
        select_workloads(WORKLOADS, args)


def test_without_published_the_limits_stay_as_they_were() -> None:
    args = parse_args([])
    assert (args.free_memory_fraction, args.max_batch, args.max_num_tokens) == (0.9, 512, 8192)
    assert args.min_row_seconds == 10.0 and parse_args(["--tiny"]).min_row_seconds == 0.0
    assert [f"{p}/{o}" for p, o, _, _ in select_workloads(WORKLOADS, args)][-1] == "2048/2048"


def test_requests_given_replace_the_planned_count_and_name_a_short_batch() -> None:
    limits = BatchLimits(max_batch=64, kv_tokens=1 << 16, block_size=16, max_num_tokens=1024)
    roof = roofline_for(ModelConfig.from_hf(LLAMA_8B), 4e12, 1e15, 2)
    planned = row_plan(parse_args([]), 128, 128, 0, limits, roof)
    assert planned.requests % 64 == 0 and planned.bound == "--max-batch"
    given = row_plan(parse_args(["--requests", "16"]), 128, 128, 0, limits, roof)
    assert (given.requests, given.batch_cap, given.bound) == (16, 64, "requests")
    scaled = row_plan(parse_args(["--scale", "0.5"]), 128, 128, 0, limits, roof)
    assert scaled.requests == planned.requests // 2
