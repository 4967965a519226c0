"""TensorRT-LLM's runtimes under their names: the Python runtime (ModelRunner,
GenerationSession, ModelConfig, SamplingConfig, StoppingCriteria,
LogitsProcessor, KVCacheManager, Session) and the C++ runtime's GptSession
(GenerationInput, GenerationOutput, WorldConfig), all generating on the
executor's EngineCore. Runs where only numpy, torch, safetensors and tokenizers
are installed."""

from worker.runtime.config import Mapping, ModelConfig, WorldConfig
from worker.runtime.generation import (
    GenerationSession,
    KVCacheManager,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from worker.runtime.gpt_session import GenerationInput, GenerationOutput, GptSession
from worker.runtime.model_runner import ModelRunner
from worker.runtime.sampling import SamplingConfig
from worker.runtime.session import Session

# The C++ runtime's name for the model description.
GptModelConfig = ModelConfig

__all__ = [
    "GenerationInput",
    "GenerationOutput",
    "GenerationSession",
    "GptModelConfig",
    "GptSession",
    "KVCacheManager",
    "LogitsProcessor",
    "LogitsProcessorList",
    "Mapping",
    "ModelConfig",
    "ModelRunner",
    "SamplingConfig",
    "Session",
    "StoppingCriteria",
    "StoppingCriteriaList",
    "WorldConfig",
]
