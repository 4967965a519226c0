"""The high-level API's configuration types under TensorRT-LLM's names:
ModelConfig (with its quant_config and parallel_config), KvCacheConfig,
QuantAlgo, SamplingConfig, which is SamplingParams itself under TensorRT-LLM's
name, and LoRARequest (the name TensorRT-LLM's and vLLM's LLM APIs give it).
Standard library only: the executor's types are applied where the LLM builds its
executor (clients/llm.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.params import SamplingParams


class QuantAlgo(enum.Enum):
    """TensorRT-LLM's quantization algorithms, by name. The LLM quantizes a float
    checkpoint on load with FP8 or W4A16 (int4 round-to-nearest) and refuses the others."""

    NO_QUANT = "no_quant"
    W8A16 = "w8a16"
    W4A16 = "w4a16"
    W4A16_AWQ = "w4a16_awq"
    W4A8_AWQ = "w4a8_awq"
    W4A16_GPTQ = "w4a16_gptq"
    W8A8_SQ_PER_CHANNEL = "w8a8_sq_per_channel"
    FP8 = "fp8"
    INT8 = "int8"


@dataclass(slots=True)
class QuantConfig:
    quant_algo: QuantAlgo | None = None
    kv_cache_quant_algo: QuantAlgo | None = None

    @property
    def requested(self) -> list[QuantAlgo]:
        return [a for a in (self.quant_algo, self.kv_cache_quant_algo) if a not in (None, QuantAlgo.NO_QUANT)]


@dataclass(slots=True)
class ParallelConfig:
    tp_size: int = 1
    pp_size: int = 1
    auto_parallel: bool = False
    world_size: int = 1  # with auto_parallel: how many GPUs to spread over


@dataclass(slots=True)
class ModelConfig:
    """What `LLM(config)` loads: `model_dir` is a checkpoint directory (one
    `LLM.save` wrote included), a .gguf file, a Hugging Face hub id, or the
    default model's name."""

    model_dir: str | Path | None = None
    max_beam_width: int = 1
    quant_config: QuantConfig = field(default_factory=QuantConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass(slots=True)
class KvCacheConfig:
    """The LLM's KV cache options; None leaves the executor's. `max_tokens`: the
    cache's size in tokens (else `free_gpu_memory_fraction` of free device memory
    after the weights). `max_new_tokens`: the default SamplingConfig's (TensorRT-LLM's
    example sets it here)."""

    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = None
    enable_block_reuse: bool | None = None
    tokens_per_block: int | None = None
    max_new_tokens: int | None = None

    def executor_fields(self) -> dict[str, Any]:
        """The fields it sets, under the executor's KvCacheConfig names."""
        fields = {"max_tokens": self.max_tokens, "free_memory_fraction": self.free_gpu_memory_fraction,
                  "enable_block_reuse": self.enable_block_reuse, "tokens_per_block": self.tokens_per_block}
        return {name: value for name, value in fields.items() if value is not None}


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter for `LLM.generate(..., lora_request=...)`: registered under
    `lora_name` from `lora_path` (a Hugging Face PEFT directory) the first time it is
    used. `lora_int_id` is accepted for code written against vLLM or TensorRT-LLM:
    tokenwire names adapters by `lora_name` alone."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | Path = ""


class SamplingConfig(SamplingParams):
    """SamplingParams under TensorRT-LLM's name, settable field by field as its
    example does (`sampling_config.beam_width = 4`); `max_new_tokens` is
    `max_tokens`. Every API that takes SamplingParams takes it."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        name = "max_tokens" if name == "max_new_tokens" else name
        if name not in SamplingParams.__dataclass_fields__:
            raise AttributeError(f"SamplingConfig has no option {name!r}")
        object.__setattr__(self, name, value)

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens

    @max_new_tokens.setter
    def max_new_tokens(self, value: int) -> None:
        object.__setattr__(self, "max_tokens", value)
