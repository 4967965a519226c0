"""The continuous-batching executor (TensorRT-LLM Executor API, in process)."""

from worker.executor.engine_core import EngineCore, StepOutput
from worker.executor.executor import Executor
from worker.executor.types import (
    CapacitySchedulerPolicy,
    ExecutorConfig,
    FinishReason,
    GuidedDecodingParams,
    IterationStats,
    KvCacheConfig,
    OutputConfig,
    ParallelConfig,
    Request,
    RequestState,
    RequestStats,
    Response,
    Result,
    SamplingConfig,
    SchedulerConfig,
)

__all__ = [
    "CapacitySchedulerPolicy",
    "EngineCore",
    "Executor",
    "ExecutorConfig",
    "FinishReason",
    "GuidedDecodingParams",
    "IterationStats",
    "KvCacheConfig",
    "OutputConfig",
    "ParallelConfig",
    "Request",
    "RequestState",
    "RequestStats",
    "Response",
    "Result",
    "SamplingConfig",
    "SchedulerConfig",
    "StepOutput",
]
