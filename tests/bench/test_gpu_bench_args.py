"""The GPU bench's command line reaches the executor it builds (no GPU needed)."""

from __future__ import annotations

import pytest

from bench.gpu_bench import parser
from bench.runner import executor_config
from worker.executor import CapacitySchedulerPolicy


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
