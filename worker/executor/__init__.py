"""The continuous-batching executor (TensorRT-LLM Executor API, in process)."""

from worker.executor.engine_core import EngineCore, StepOutput
from worker.executor.executor import Executor
from worker.executor.types import (
    CapacitySchedulerPolicy,
    DraftSource,
    ExecutorConfig,
    FinishReason,
    GuidedDecodingConfig,
    GuidedDecodingParams,
    IterationStats,
    KvCacheConfig,
    OutputConfig,
    PackedWordList,
    Request,
    RequestState,
    RequestStats,
    Response,
    Result,
    SamplingConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

__all__ = [
    "CapacitySchedulerPolicy",
    "DraftSource",
    "EngineCore",
    "Executor",
    "ExecutorConfig",
    "FinishReason",
    "GuidedDecodingConfig",
    "GuidedDecodingParams",
    "IterationStats",
    "KvCacheConfig",
    "OutputConfig",
    "PackedWordList",
    "Request",
    "RequestState",
    "RequestStats",
    "Response",
    "Result",
    "SamplingConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StepOutput",
]
