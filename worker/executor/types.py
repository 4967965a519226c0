"""The executor's public types, after the TensorRT-LLM Executor API (snake_case).

Plain dataclasses on purpose: the executor must run where pydantic is not
installed (the GPU host). The wire models in `protocol` mirror these fields and
validate untrusted input; the executor still checks everything that depends on
the model (vocabulary, context length) itself.

The sampling and output options, the finish reasons, the request states and
the iteration and request stats are declared once in `protocol`'s pure-data
modules (standard library only) and used here as they are.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from protocol.options import OutputConfig as OutputConfig
from protocol.options import SamplingConfig as SamplingConfig
from protocol.stats import IterationStats as IterationStats
from protocol.stats import RequestStats as RequestStats
from protocol.status import FinishReason as FinishReason
from protocol.status import RequestState as RequestState


class CapacitySchedulerPolicy(enum.Enum):
    # Admit a request only if the KV blocks for its whole prompt + max_tokens are free.
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"
    # Admit greedily; when blocks run out, preempt the newest requests by recompute.
    MAX_UTILIZATION = "max_utilization"


@dataclass(slots=True)
class GuidedDecodingParams:
    guide_type: str  # "json" | "json_schema" | "regex" | "ebnf_grammar"
    guide: str | None = None


@dataclass(frozen=True, slots=True)
class PackedWordList:
    """TensorRT-LLM's `[2, len]` word-list tensor, named so that it is never
    mistaken for two words: `tokens` holds every word's tokens back to back and
    `offsets` where the words meet, -1 padded to len(tokens). Both layouts are
    read: the Executor API documents' exclusive prefix sum, which starts at 0 and ends
    at the last word's end (`[0, 3, 5, 9, -1, ...]`, so single-token words need
    one extra column), and TensorRT-LLM's end offsets (`[3, 5, 9, -1, ...]`).
    Tokens after the last word's end are padding."""

    tokens: list[int]
    offsets: list[int]

    def words(self) -> list[list[int]]:
        """The words it holds; ValueError if the offsets are not a valid layout."""
        ends = [o for o in self.offsets if o != -1]
        if any(o != -1 for o in self.offsets[len(ends):]):
            raise ValueError("offsets must be word boundaries followed only by -1 padding")
        if ends and ends[0] == 0:
            ends = ends[1:]  # the prefix-sum layout: the leading 0 is the first word's start
        if not ends or ends != sorted(set(ends)) or ends[-1] > len(self.tokens):
            raise ValueError(f"offsets {self.offsets} are not increasing boundaries within {len(self.tokens)} tokens")
        return [list(self.tokens[a:b]) for a, b in zip([0, *ends[:-1]], ends, strict=True)]


# Token sequences: a list of words (each a list of token ids), or the packed form.
WordList = list[list[int]] | PackedWordList


class DraftSource(enum.StrEnum):
    # Tokens the caller expects the output to continue with (an edit's original
    # text, a cached answer): verified as far as they match.
    DRAFT_TOKENS = "draft_tokens"
    # n-gram matching against the prompt and the output so far: no second model.
    PROMPT_LOOKUP = "prompt_lookup"
    # The worker's draft model (ExecutorConfig.draft_model), proposing greedily.
    DRAFT_MODEL = "draft_model"


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding for one request (Request.speculative_config) or, as the
    default of every request, for a worker (ExecutorConfig.speculative_config).
    Each step verifies up to `num_draft_tokens` proposed tokens in one forward; the
    output is what ordinary decoding gives (see worker/executor/speculative.py)."""

    source: DraftSource = DraftSource.PROMPT_LOOKUP
    num_draft_tokens: int = 4  # most tokens proposed per step; 0 turns speculation off
    # DRAFT_TOKENS: the expected continuation of the output, from its first token.
    draft_tokens: list[int] | None = None
    # PROMPT_LOOKUP: the longest suffix n-gram tried first, down to the shortest.
    max_ngram: int = 3
    min_ngram: int = 1


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """The LoRA adapter a request runs under, by the name it was registered with
    (ExecutorConfig.lora_adapters, EngineCore.register_lora)."""

    name: str


@dataclass(frozen=True, slots=True, eq=False)
class PromptTuningConfig:
    """A request's own prompt embeddings: a prompt token id t >= vocab_size takes row
    t - vocab_size of the table as its embedding instead of the vocabulary's."""

    embedding_table: np.ndarray  # float [rows, hidden]


@dataclass(frozen=True, slots=True)
class EmbeddingConfig:
    """The request answers with its prompt's embedding and generates nothing: the final
    hidden state (after the model's last norm), pooled over the prompt, unit L2 norm
    (worker/executor/embeddings.py). `pooling`: "last" | "mean"; None: the model's own
    (its sentence-transformers pooling config, else "last")."""

    pooling: str | None = None


@dataclass(slots=True)
class Request:
    input_token_ids: list[int]
    max_tokens: int
    streaming: bool = False
    sampling_config: SamplingConfig = field(default_factory=SamplingConfig)
    output_config: OutputConfig = field(default_factory=OutputConfig)
    end_id: int | None = None  # None: the model's eos token
    pad_id: int | None = None  # the padding of worker/runtime's [batch, beam, len] outputs
    # Token sequences: plain lists of words, or TensorRT-LLM's [2, len] tensor as a PackedWordList.
    bad_words: WordList | None = None
    stop_words: WordList | None = None
    embedding_bias: list[float] | None = None
    client_id: int | None = None
    priority: float = 0.5  # 0.0 lowest .. 1.0 highest, as in TensorRT-LLM
    num_return_sequences: int = 1
    return_all_generated_tokens: bool = False
    logits_post_processor_name: str | None = None
    guided_decoding_params: GuidedDecodingParams | None = None
    speculative_config: SpeculativeConfig | None = None  # None: the executor's default
    lora_config: LoraConfig | None = None  # None: the base model
    prompt_tuning_config: PromptTuningConfig | None = None
    # Output tokens already delivered by an earlier run (protocol/continuation.py).
    resumed_token_ids: list[int] | None = None
    embedding_config: EmbeddingConfig | None = None  # set: an embedding instead of generation


@dataclass(slots=True)
class PromptLogProbs:
    """Entries for prompt tokens 1 .. P-1, in order."""

    log_probs: list[float] = field(default_factory=list)
    # Per entry: the k most likely tokens at that position, most likely first, and their log probs.
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_log_probs: list[list[float]] = field(default_factory=list)
    rows: int = 0  # prompt rows seen so far (positions 0 .. rows-1)


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
    prompt_log_probs: PromptLogProbs | None = None  # in a final result, when asked for
    embedding: np.ndarray | None = None  # float32 [hidden], unit L2 norm: a request with embedding_config


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
    # Bytes of host memory (per rank) for the host tier: full prefix blocks evicted from
    # the device pool are copied there, LRU, and copied back on a prefix hit. 0: off.
    host_cache_size: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT


@dataclass(frozen=True, slots=True)
class GuidedDecodingConfig:
    """The tokenizer guided decoding compiles grammars against (TensorRT-LLM's
    GuidedDecodingConfig), for an executor whose model has no tokenizer of its
    own or whose grammars should see another vocabulary. `encoded_vocab`: every
    token's string, by id; `tokenizer_str`: the Hugging Face tokenizer.json text
    (for its byte-level or sentencepiece metadata); `stop_token_ids`: the tokens
    that end a grammar (default: the model's eos tokens)."""

    encoded_vocab: list[str]
    tokenizer_str: str | None = None
    stop_token_ids: list[int] | None = None
    backend: str = "xgrammar"  # the one backend there is, as in TensorRT-LLM


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How many devices run the model (TensorRT-LLM's WorldConfig): the layers split
    into `pipeline_parallel_size` stages of contiguous layers, and the projections of
    each stage's layers over `tensor_parallel_size` ranks (worker/parallel); one
    process per device, tp * pp of them."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Micro-batches a step's sequences are cut into, so the stages overlap (0: one per stage).
    micro_batches: int = 0
    # Mixture-of-experts layers: each tensor-parallel rank holds whole experts, a contiguous
    # run of them, instead of a slice of every expert (worker/parallel/expert_parallel.py).
    expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True, slots=True)
class PeftCacheConfig:
    """How many LoRA adapters are held, and how large they may be. Device slots are
    allocated at start, before the KV cache is sized, each for an adapter of rank up
    to `max_rank` on every projection of every layer."""

    max_device_adapters: int = 8  # adapters resident on the device at once (one slot each)
    max_host_adapters: int = 32  # adapters kept loaded in host memory; others are re-read from disk
    max_rank: int = 64  # the largest rank an adapter may have


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
    # > 0: a RequestStats record for every live request after each iteration (TensorRT-LLM's
    # request_stats_max_iterations); 0: one record per request, when it ends.
    request_stats_max_iterations: int = 0
    # True: a sampled token's log prob is over the tokens its sampling could pick
    # (after top-k / top-p / min-p, at its temperature; 0 for greedy), TensorRT-LLM's
    # default; False: over the whole vocabulary. Beam search keeps its own.
    normalize_log_probs: bool = False
    guided_decoding_config: GuidedDecodingConfig | None = None  # None: the model's own tokenizer
    # Speculative decoding for requests that do not set their own; None: off.
    speculative_config: SpeculativeConfig | None = None
    # Checkpoint directory or .gguf of the draft model (DraftSource.DRAFT_MODEL):
    # a smaller model sharing the target's tokenizer, loaded on the same backend.
    draft_model: str | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    # LoRA: on when either is set. Adapters (name -> PEFT directory) are registered at start.
    peft_cache_config: PeftCacheConfig | None = None
    lora_adapters: dict[str, str] = field(default_factory=dict)
    # True: a request's logits do not depend on which requests share its batch, so a
    # seeded request samples the same tokens whatever the load (docs/deterministic.md);
    # costs throughput. Float weights only.
    deterministic: bool = False

    @property
    def lora_enabled(self) -> bool:
        return self.peft_cache_config is not None or bool(self.lora_adapters)
