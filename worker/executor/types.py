"""The executor's public types, after the TensorRT-LLM Executor API (snake_case).

Plain dataclasses on purpose: the executor must run where pydantic is not
installed (the GPU host). The wire models in `protocol` mirror these fields and
validate untrusted input; the executor still checks everything that depends on
the model (vocabulary, context length) itself.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class FinishReason(enum.IntEnum):
    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5


class CapacitySchedulerPolicy(enum.Enum):
    # Admit a request only if the KV blocks for its whole prompt + max_tokens are free.
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"
    # Admit greedily; when blocks run out, preempt the newest requests by recompute.
    MAX_UTILIZATION = "max_utilization"


class RequestState(enum.Enum):
    QUEUED = "queued"
    CONTEXT = "context"
    GENERATION = "generation"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True)
class SamplingConfig:
    """How to pick the next token. `None` means the executor default."""

    beam_width: int = 1
    top_k: int | None = None  # 0 or None: no top-k
    top_p: float | None = None  # None or 1.0: no top-p
    top_p_min: float | None = None
    top_p_reset_ids: int | None = None
    top_p_decay: float | None = None
    min_p: float | None = None
    seed: int | None = None
    temperature: float | None = None  # None: 1.0; 0.0: greedy
    min_tokens: int | None = None
    beam_search_diversity_rate: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    early_stopping: int | None = None
    no_repeat_ngram_size: int | None = None

    @property
    def is_greedy(self) -> bool:
        # As in TensorRT-LLM, a config that asks for no randomness decodes greedily.
        unset = all(v is None for v in (self.temperature, self.top_k, self.top_p, self.min_p))
        return unset or self.temperature == 0.0 or self.top_k == 1


@dataclass(slots=True)
class OutputConfig:
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    # TensorRT-LLM defaults this to False (outputs repeat the prompt); a service
    # almost never wants the prompt echoed, so we default to True.
    exclude_input_from_output: bool = True
    top_n_log_probs: int = 0


@dataclass(slots=True)
class GuidedDecodingParams:
    guide_type: str  # "json" | "json_schema" | "regex" | "ebnf_grammar"
    guide: str | None = None


@dataclass(slots=True)
class Request:
    input_token_ids: list[int]
    max_tokens: int
    streaming: bool = False
    sampling_config: SamplingConfig = field(default_factory=SamplingConfig)
    output_config: OutputConfig = field(default_factory=OutputConfig)
    end_id: int | None = None  # None: the model's eos token
    pad_id: int | None = None
    # Token sequences. The TensorRT-LLM [2, len] flattened form is accepted too.
    bad_words: list[list[int]] | None = None
    stop_words: list[list[int]] | None = None
    embedding_bias: list[float] | None = None
    client_id: int | None = None
    priority: float = 0.5  # 0.0 lowest .. 1.0 highest, as in TensorRT-LLM
    num_return_sequences: int = 1
    return_all_generated_tokens: bool = False
    logits_post_processor_name: str | None = None
    guided_decoding_params: GuidedDecodingParams | None = None


@dataclass(slots=True)
class Result:
    is_final: bool
    # One list per beam (beam_width lists; a single list when beam_width == 1).
    output_token_ids: list[list[int]]
    finish_reasons: list[FinishReason]
    sequence_index: int = 0
    is_sequence_final: bool = False
    cum_log_probs: list[float] | None = None
    log_probs: list[list[float]] | None = None
    # Per beam, per generated token: the output_config.top_n_log_probs most likely
    # tokens, most likely first, and their log probs.
    top_token_ids: list[list[list[int]]] | None = None
    top_log_probs: list[list[list[float]]] | None = None
    context_logits: object | None = None  # array [prompt_len, vocab] when asked for
    generation_logits: object | None = None  # array [beams, new_tokens, vocab]


@dataclass(slots=True)
class Response:
    request_id: int
    result: Result | None = None
    error_msg: str | None = None
    client_id: int | None = None

    @property
    def has_error(self) -> bool:
        return self.error_msg is not None


@dataclass(frozen=True, slots=True)
class KvCacheConfig:
    tokens_per_block: int = 32
    # Exactly one sizing rule applies: max_tokens when set, else the fraction of
    # free device memory (after weights and activations).
    max_tokens: int | None = None
    free_memory_fraction: float = 0.9
    enable_block_reuse: bool = True
    # "fp8": K and V stored as float8 e4m3 (half the bytes, twice the tokens); None: the
    # compute dtype. Torch backend on CUDA only.
    dtype: str | None = None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    max_batch_size: int = 64
    max_num_tokens: int = 2048  # tokens per iteration (context chunks + generation)
    max_beam_width: int = 1
    enable_chunked_context: bool = True
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    backend: str = "auto"  # "numpy" | "torch" | "auto" (torch on CUDA when present, else numpy)
    device: str | None = None  # torch device string, e.g. "cuda:0" or "cpu"
    dtype: str | None = None  # compute dtype: "float32" (numpy), "bfloat16" default on CUDA
    # Quantize a float checkpoint's linear layers as the model loads: "fp8" | "int4" (RTN).
    # A quantized checkpoint (compressed-tensors, AWQ) is recognised without it.
    quantization: str | None = None
    # Schedule step N+1 while step N runs. None: on when the backend launches
    # asynchronously (CUDA); the numpy backend gains nothing from it.
    overlap_scheduling: bool | None = None
    # name -> callable(request_id, logits, tokens_so_far, client_id) -> logits; the
    # name "batched" holds the batched callback (see worker/executor/logits_processors.py).
    logits_post_processor_map: dict[str, object] | None = None
    # The same by import path, "name=package.module:function", for a service whose
    # config file names them (worker/executor/logits_processors.py loads them).
    logits_post_processors: tuple[str, ...] = ()
    iteration_stats_max: int = 1000  # how many recent stats records to keep


@dataclass(slots=True)
class IterationStats:
    timestamp: float
    iter: int
    iter_latency_ms: float
    num_active_requests: int
    num_queued_requests: int
    num_context_requests: int
    num_generation_requests: int
    num_scheduled_tokens: int
    max_num_blocks: int
    free_num_blocks: int
    used_num_blocks: int
    reused_blocks: int  # cumulative prefix-cache hits, in blocks


@dataclass(slots=True)
class RequestStats:
    request_id: int
    state: RequestState
    prompt_tokens: int
    context_prefill_position: int  # prompt tokens processed so far
    num_generated_tokens: int
    queue_time_ms: float | None
    time_to_first_token_ms: float | None
    allocated_blocks: int
    reused_blocks: int
    timestamp: float = field(default_factory=time.time)
