"""The submit message: one generation request, field for field the executor's
`Request` (worker/executor/types.py), plus what only the service needs. Its
sampling and output options are built from their one declaration,
protocol/options.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Self

from pydantic import Field, model_validator

from protocol import options
from protocol.base import Message, Name, Uint64, WireModel
from protocol.continuation import continuation_problem
from protocol.derive import wire_model
from protocol.kv_transfer import KvHandoff
from protocol.packed import Floats, TokenIds
from protocol.results import FunctionCall, Logits

if TYPE_CHECKING:
    # What type checkers see: the declaration's fields on a wire model, built from keywords.
    class SamplingConfig(WireModel, options.SamplingConfig):
        def __init__(self, **fields: Any) -> None: ...

    class OutputConfig(WireModel, options.OutputConfig):
        def __init__(self, **fields: Any) -> None: ...
else:
    SamplingConfig = wire_model(options.SamplingConfig, module=__name__)
    OutputConfig = wire_model(options.OutputConfig, module=__name__)


class GuidedDecodingParams(WireModel):
    guide_type: Literal["json", "json_schema", "regex", "ebnf_grammar"]
    guide: str | None = None

    @model_validator(mode="after")
    def _guide_given(self) -> Self:
        if self.guide_type != "json" and not self.guide:
            raise ValueError(f"guide_type {self.guide_type!r} needs a non-empty guide")
        return self


class SpeculativeConfig(WireModel):
    """Speculative decoding for this request (worker/executor/types.py SpeculativeConfig)."""

    source: Literal["draft_tokens", "prompt_lookup", "draft_model"] = "prompt_lookup"
    num_draft_tokens: int = Field(4, ge=0, le=16)  # 0 turns speculation off
    draft_tokens: TokenIds | None = None  # the expected continuation of the output
    max_ngram: int = Field(3, ge=1)
    min_ngram: int = Field(1, ge=1)


class LoraConfig(WireModel):
    """The LoRA adapter a request runs under, by the name its worker registered it as."""

    name: Name


class PromptTuningConfig(WireModel):
    """A request's prompt embedding table, float32 [rows, hidden]: a prompt token id
    `t >= vocab_size` takes row `t - vocab_size` as its embedding. The worker checks
    the width against its model's hidden size."""

    embedding_table: Logits

    @model_validator(mode="after")
    def _two_dimensional(self) -> Self:
        shape = self.embedding_table.shape
        if len(shape) != 2 or 0 in shape:
            raise ValueError(f"embedding_table must be [rows, hidden] with rows, hidden >= 1; got shape {shape}")
        return self

    @property
    def rows(self) -> int:
        return self.embedding_table.shape[0]


Pooling = Literal["last", "mean"]  # how an embedding pools the final hidden states over the prompt


class EmbeddingConfig(WireModel):
    """Ask for the prompt's embedding instead of generated tokens: the final hidden
    state (after the model's last norm), pooled over the prompt and scaled to unit L2
    norm, returned as `Result.embedding`. `pooling`: "last" (the last token's state,
    what decoder embedding models are trained for) or "mean" (the average over the
    prompt's tokens); None: the checkpoint's sentence-transformers pooling, else "last"."""

    pooling: Pooling | None = None


class ChatMessage(WireModel):
    """One turn of a chat, as OpenAI's and Hugging Face's chat templates take it: an
    assistant's turn may hold the calls it made, a tool's turn names the call it answers."""

    role: Name
    content: str = ""
    tool_calls: list[FunctionCall] | None = Field(None, min_length=1)
    tool_call_id: Name | None = None


class ToolSpec(WireModel):
    """A function a chat's model may call (OpenAI's `tools` entry): its parameters'
    JSON schema as JSON text, as guides are; None: any object."""

    name: Name
    description: str | None = None
    parameters: str | None = Field(None, min_length=2)


# tool_choice: one of these, or a tool's name (a forced call to it).
TOOL_CHOICES = ("none", "auto", "required")


class Submit(Message):
    """Start one request. Exactly one of `prompt` (the gateway tokenizes it),
    `messages` (the gateway renders them with the model's chat template, then
    tokenizes) and `input_token_ids` is given."""

    kind: ClassVar[str] = "submit"

    request_id: Name  # chosen by the client, unique among its live requests
    model: Name | None = None  # None: the service's default model
    prompt: str | None = Field(None, min_length=1)
    input_token_ids: TokenIds | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    max_tokens: int = Field(ge=1)
    streaming: bool = False
    sampling_config: SamplingConfig = Field(default_factory=SamplingConfig)
    output_config: OutputConfig = Field(default_factory=OutputConfig)
    end_id: int | None = Field(None, ge=-1)  # -1: no end token (generate max_tokens)
    pad_id: int | None = Field(None, ge=0)
    bad_words: list[Annotated[TokenIds, Field(min_length=1)]] | None = None
    stop_words: list[Annotated[TokenIds, Field(min_length=1)]] | None = None
    # Stop strings, matched by the gateway on the detokenized text.
    stop: list[Annotated[str, Field(min_length=1)]] | None = None
    embedding_bias: Floats | None = None
    client_id: Uint64 | None = None
    priority: float = Field(0.5, ge=0.0, le=1.0)
    num_return_sequences: int = Field(1, ge=1)
    return_all_generated_tokens: bool = False
    logits_post_processor_name: str | None = Field(None, min_length=1)
    guided_decoding_params: GuidedDecodingParams | None = None
    # Set by a gateway toward a worker (a client's value is not passed on) when the
    # client's request id is taken by another client's request there, so `request_id`
    # is the gateway's own: the client's id, which names the request in Redis (its
    # cancel flag, its stats) and in logs.
    client_request_id: Name | None = None
    speculative_config: SpeculativeConfig | None = None  # None: the worker's default
    lora_config: LoraConfig | None = None  # None: the base model
    prompt_tuning_config: PromptTuningConfig | None = None
    # The output tokens this request's reader already received from an earlier run of
    # it (protocol/continuation.py): computed as context, counted as generated, not sent again.
    resumed_token_ids: TokenIds | None = Field(None, min_length=1)
    # Set: the request answers with its prompt's embedding, and generates nothing.
    embedding_config: EmbeddingConfig | None = None
    # A chat's tools, which its template renders: the gateway guides a forced call
    # ("required", or a tool's name) to the tools' schemas and reads the calls the output
    # makes into the final result's tool_calls. tool_choice None: "auto".
    tools: list[ToolSpec] | None = Field(None, min_length=1, max_length=128)
    tool_choice: Name | None = None
    parallel_tool_calls: bool = True
    # Disaggregated serving (protocol/kv_transfer.py). Toward a prefill worker: it computes the
    # first token only, then hands the request's KV blocks on. Toward the decode worker: the
    # continuation names the transfer whose blocks it waits for.
    kv_handoff: KvHandoff | None = None
    kv_transfer_id: Name | None = None

    @property
    def lora(self) -> str | None:
        """The LoRA adapter's name, if any."""
        return None if self.lora_config is None else self.lora_config.name

    @model_validator(mode="after")
    def _check(self) -> Self:
        given = (self.prompt is not None) + (self.input_token_ids is not None) + (self.messages is not None)
        if given != 1:
            raise ValueError("exactly one of prompt, messages and input_token_ids must be given")
        beams = self.sampling_config.beam_width
        if beams > 1 and self.num_return_sequences > beams:
            raise ValueError(
                f"num_return_sequences ({self.num_return_sequences}) must not exceed "
                f"sampling_config.beam_width ({beams}) in beam search"
            )
        if self.prompt_tuning_config is not None and self.input_token_ids is None:
            raise ValueError("prompt_tuning_config needs input_token_ids: its rows are named by token ids")
        problem = continuation_problem(self, None)  # the vocabulary is the worker's to check
        if problem is not None:
            raise ValueError(problem)
        if self.embedding_config is not None and self.streaming:
            raise ValueError("embedding_config: an embedding comes whole; streaming must be false")
        if self.tools is not None or self.tool_choice is not None:
            self._check_tools()
        return self

    def _check_tools(self) -> None:
        names = [t.name for t in self.tools or []]
        choice = self.tool_choice
        if choice is not None and choice not in TOOL_CHOICES and choice not in names:
            raise ValueError(f"tool_choice {choice!r}: neither one of {list(TOOL_CHOICES)} nor a tool's name "
                             f"(tools: {names})")
        if choice not in (None, "none") and not names:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        if self.tools is None:
            return
        if self.messages is None:
            raise ValueError("tools: only a chat (messages) can be given tools")
        if len(set(names)) != len(names):
            raise ValueError(f"tools: names must differ; got {names}")
        if self.embedding_config is not None:
            raise ValueError("tools: not with embedding_config")
        if self.num_return_sequences > 1 or self.sampling_config.beam_width > 1:
            raise ValueError("tools: calls are read from one output; not with num_return_sequences > 1 or beams")
        if choice not in (None, "none", "auto") and self.guided_decoding_params is not None:
            raise ValueError("guided_decoding_params: not with a forced tool call (tool_choice required or named)")
