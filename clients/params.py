"""What every API takes and gives back: `SamplingParams` in, `RequestOutput` out.

`Client`, `AsyncClient`, `JobQueue` and the in-process `LLM` all take the same
SamplingParams (their keyword-argument style builds one), so every option of
the executor is reachable from each of them. `request_fields` is the one
mapping from these options to the executor's `Request` and the wire's
`Submit` (protocol/request.py), which share their field names.

Plain dataclasses, importing nothing at run time beyond the standard library
and protocol/options.py (the options' one declaration, itself standard library
only): the client library, the jobs client and the LLM all import this.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from protocol import options

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from protocol import FinishReason, FunctionCall

# SamplingParams fields that are the executor's SamplingConfig fields, name for name.
SAMPLING_CONFIG_FIELDS = tuple(f.name for f in fields(options.SamplingConfig))
# And those of its OutputConfig; the prompt is never echoed in outputs, which
# carry it apart (RequestOutput.prompt_token_ids).
OUTPUT_CONFIG_FIELDS = tuple(f.name for f in fields(options.OutputConfig) if f.name != "exclude_input_from_output")


@dataclass(frozen=True, slots=True, kw_only=True)
class Speculation:
    """Speculative decoding for a request: each step verifies up to `num_draft_tokens`
    proposed tokens, and the output is what ordinary decoding gives
    (worker/executor/speculative.py says why). `source`: "prompt_lookup" (n-grams of
    the prompt and the output so far), "draft_model" (the worker's draft model) or
    "draft_tokens" (`draft_tokens`: the continuation the caller expects)."""

    source: str = "prompt_lookup"
    num_draft_tokens: int = 4  # 0 turns speculation off for this request
    draft_tokens: list[int] | None = None
    max_ngram: int = 3  # prompt lookup: the longest suffix n-gram tried first, down to min_ngram
    min_ngram: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """One request's options; None leaves the executor's default. Validated where
    the request is checked: by the wire's Submit (the ZeroMQ and jobs clients,
    before anything is sent) or by the executor (LLM, as an error result)."""

    max_tokens: int = 64
    # -- sampling (TensorRT-LLM semantics)
    temperature: float | None = None  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    top_p_min: float | None = None  # top-p decay: the floor
    top_p_reset_ids: int | None = None  # the token that resets the decay
    top_p_decay: float | None = None
    min_p: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    # -- penalties
    repetition_penalty: float | None = None  # multiplicative, over prompt and output
    presence_penalty: float | None = None  # additive, over output tokens
    frequency_penalty: float | None = None  # additive x count, over output tokens
    no_repeat_ngram_size: int | None = None
    # -- beam search (early_stopping 1 stops at beam_width finished beams, 0 when
    # none can improve, -1 never before max_tokens)
    beam_width: int = 1
    length_penalty: float | None = None
    early_stopping: int | None = None
    beam_search_diversity_rate: float | None = None
    num_return_sequences: int = 1  # with beam_width > 1: the best beams, at most beam_width
    # -- when to stop
    stop: list[str] = field(default_factory=list)  # strings, matched on the decoded text
    stop_token_ids: list[list[int]] | None = None  # token sequences, matched by the executor
    bad_token_ids: list[list[int]] | None = None  # token sequences never generated
    end_id: int | None = None  # None: the model's end-of-sequence token
    ignore_eos: bool = False  # generate max_tokens whatever comes
    # -- what comes back besides tokens and text
    return_log_probs: bool = False
    top_n_log_probs: int = 0  # per token, the n likeliest tokens and their log probs
    prompt_log_probs: int | None = None  # per prompt token, its log prob and the k likeliest at its position
    return_context_logits: bool = False  # RequestOutput.context_logits
    return_generation_logits: bool = False  # CompletionOutput.generation_logits
    # -- steering the logits
    embedding_bias: list[float] | None = None  # one value per vocabulary token
    logits_post_processor: str | None = None  # a name configured in the executor
    # Guided decoding (the executor's `guided` extra): at most one of these.
    guided_json: str | dict[str, Any] | bool | None = None  # a JSON schema, or True for any JSON
    guided_regex: str | None = None
    guided_grammar: str | None = None  # EBNF
    # -- scheduling
    priority: float = 0.5  # 0.0 lowest .. 1.0 highest
    speculative: Speculation | None = None  # None: the worker's default (speculation changes no output)
    # -- adapters
    lora: str | None = None  # the LoRA adapter to run under, by the name its worker (or LLM) registered

    def request_fields(self) -> dict[str, Any]:
        """These options as the executor's Request and the wire's Submit name them
        (the configs as dicts), everything but the prompt, streaming and the stop
        strings (only text shows those: protocol/text.py)."""
        return {
            "max_tokens": self.max_tokens,
            "sampling_config": {name: getattr(self, name) for name in SAMPLING_CONFIG_FIELDS},
            "output_config": {name: getattr(self, name) for name in OUTPUT_CONFIG_FIELDS},
            "end_id": -1 if self.ignore_eos else self.end_id,
            "bad_words": _token_lists(self.bad_token_ids),
            "stop_words": _token_lists(self.stop_token_ids),
            "embedding_bias": None if self.embedding_bias is None else list(self.embedding_bias),
            "priority": self.priority,
            "num_return_sequences": self.num_return_sequences,
            "logits_post_processor_name": self.logits_post_processor,
            "guided_decoding_params": self._guide(),
            "speculative_config": None if self.speculative is None else asdict(self.speculative),
            "lora_config": None if self.lora is None else {"name": self.lora},
        }

    def _guide(self) -> dict[str, str | None] | None:
        guides = []
        if self.guided_json is not None and self.guided_json is not False:
            if self.guided_json is True:
                guides.append({"guide_type": "json", "guide": None})
            else:
                schema = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
                guides.append({"guide_type": "json_schema", "guide": schema})
        if self.guided_regex is not None:
            guides.append({"guide_type": "regex", "guide": self.guided_regex})
        if self.guided_grammar is not None:
            guides.append({"guide_type": "ebnf_grammar", "guide": self.guided_grammar})
        if len(guides) > 1:
            raise ValueError("give at most one of guided_json, guided_regex and guided_grammar")
        return guides[0] if guides else None


def _token_lists(lists: list[list[int]] | None) -> list[list[int]] | None:
    return [list(ids) for ids in lists] if lists else None


def sampling_params(params: SamplingParams | None, options: dict[str, Any]) -> SamplingParams:
    """The keyword-argument style of the APIs: `options` (SamplingParams fields)
    over `params` (default: SamplingParams()). A misspelt option raises TypeError."""
    return replace(params or SamplingParams(), **options)


@dataclass(slots=True)
class CompletionOutput:
    """One returned sequence."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    log_probs: list[float] | None = None
    cum_log_prob: float | None = None
    # Per generated token, with top_n_log_probs: the likeliest tokens, most likely
    # first, and their log probs.
    top_token_ids: list[list[int]] | None = None
    top_log_probs: list[list[float]] | None = None
    generation_logits: npt.NDArray[np.float32] | None = None  # [generated tokens, vocab]
    # A chat given tools: the calls its output made (then `text`, unless it streamed, is the
    # content outside them).
    tool_calls: list[FunctionCall] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A request's outputs so far (or whole, once `finished`)."""

    request_id: str
    outputs: list[CompletionOutput]
    prompt: str | None = None  # as given, when it was text
    prompt_token_ids: list[int] | None = None  # where known: the LLM tokenizes here, the service in its gateway
    finished: bool = False
    context_logits: npt.NDArray[np.float32] | None = None  # [prompt tokens, vocab]
    embedding: npt.NDArray[np.float32] | None = None  # [hidden], unit length: an embedding request's only output

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """What one sequence added since the last chunk (with beam search: the best
    beam so far, whole, since beams are replaced rather than extended)."""

    request_id: str
    index: int  # sequence index
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None  # set on the sequence's last chunk
    is_final: bool  # the request's last chunk
