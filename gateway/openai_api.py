"""OpenAI's HTTP API in tokenwire's terms: request bodies to `protocol.Submit`,
results to completion objects and stream chunks, errors to OpenAI's shape.

No I/O here (gateway/http_front.py serves it). Bodies are validated by pydantic:
a bad parameter is a 400 naming the field. tokenwire's own options (top_k,
min_p, beam_width, repetition_penalty, ...: any `SamplingConfig` field) ride
as extra body fields, as vLLM's do (`extra_body=` in the openai SDK).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

import protocol
from gateway.chat_output import OutputRules
from gateway.echo import Echo, Entry, prompt_entries, vllm_prompt_logprobs
from protocol import ErrorCode, FinishReason, tool_calls

# HTTP status and OpenAI error type for each of the gateway's error codes.
STATUS: dict[str, tuple[int, str]] = {
    ErrorCode.PROTOCOL: (400, "invalid_request_error"),
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.UNKNOWN_MODEL: (404, "not_found_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable"),
    ErrorCode.DRAINING: (503, "service_unavailable"),
    ErrorCode.INTERNAL: (500, "server_error"),
}


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "code", "param"}}."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param

    @classmethod
    def from_code(cls, code: str, message: str) -> ApiError:
        status, type_ = STATUS.get(code, (500, "server_error"))
        return cls(status, message, type_, "model_not_found" if code == ErrorCode.UNKNOWN_MODEL else str(code))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def invalid(e: ValidationError | ValueError) -> ApiError:
    if isinstance(e, ValidationError):
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        msg = str(first["msg"]).removeprefix("Value error, ")  # a validator's ValueError, as pydantic words it
        return ApiError(400, f"{param}: {msg}" if param else msg, "invalid_request_error", "invalid_value", param)
    return ApiError(400, str(e), "invalid_request_error", "invalid_value")


class _JsonSchema(BaseModel):
    name: str = "output"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


MAX_PROMPTS = 128  # a list of prompts in one completion request: each is a request of its own
MAX_BIASED = 1024  # tokens a logit_bias may name


class _Common(BaseModel):
    """Fields both endpoints take. Unknown fields are allowed: tokenwire's options
    are checked by name against SamplingConfig (`extra_sampling`)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    # OpenAI's default, as vLLM and SGLang keep it: an OpenAI client that leaves it out
    # samples (n > 1 gives n different choices). Native clients keep TensorRT-LLM's
    # default, greedy; temperature 0 is greedy here too.
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # Token id (as a string, as JSON keys are) -> a bias added to its logit, -100 (banned) to 100 (forced).
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=MAX_BIASED)
    # Accepted and ignored: nothing here depends on who asks, for what, or on which tier.
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    store: bool | None = None  # stored chat completions are OpenAI's dashboard's; the Responses API stores its own
    # tokenwire's own, as vLLM names the common ones.
    ignore_eos: bool = False
    min_tokens: int | None = Field(None, ge=0)
    guided_regex: str | None = Field(None, min_length=1)  # the output matches this regular expression

    def stops(self) -> list[str] | None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s] or None if stops else None

    def extra_sampling(self) -> dict[str, Any]:
        known = protocol.SamplingConfig.model_fields
        extra = dict(self.model_extra or {})
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise ApiError(400, f"unknown parameter(s): {', '.join(unknown)}", "invalid_request_error",
                           "unknown_parameter", unknown[0])
        return extra


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: the prompt alone, echoed (scoring a text)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: each prompt token's, and the likeliest there

    @model_validator(mode="after")
    def _prompts_given(self) -> CompletionRequest:
        prompts = self.prompts()
        if not prompts or not all(prompts):
            raise ValueError("prompt: must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts a request, got {len(prompts)}")
        if len(prompts) > 1 and self.stream:
            raise ValueError("stream: a streamed completion takes one prompt (send a request for each)")
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise ValueError("max_tokens: 0 generates nothing; it takes echo or prompt_logprobs")
        if self.stop and (self.echo or self.prompt_logprobs is not None):
            # A stop string ends the request at the gateway, before the worker's last result (which carries them).
            raise ValueError(f"stop: not with {'echo' if self.echo else 'prompt_logprobs'}")
        if self.stream and (self.echo or self.prompt_logprobs is not None):
            raise ValueError(f"{'echo' if self.echo else 'prompt_logprobs'}: not streamed (the prompt's log probs "
                             "come with the last token); ask without stream")
        if len(prompts) == 1:
            self.prompt = prompts[0]  # a list of one is that one
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, as OpenAI takes them: one (text or token ids), or a list of either;
        choice k*n + i of the response is prompt k's i-th."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)
        return [p]  # type: ignore[list-item]

    def each_prompt(self) -> list[CompletionRequest]:
        """This request once for each prompt."""
        prompts = self.prompts()
        return [self] if len(prompts) == 1 else [self.model_copy(update={"prompt": p}) for p in prompts]


def _arguments_as_object(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        raise ValueError(f"messages: tool call arguments are not JSON: {function['arguments'][:80]!r}") from None
    return {**call, "function": {**function, "arguments": arguments}}


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: templates may read them

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text: a list of parts keeps its text parts."""
        if isinstance(self.content, list):
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise ValueError("messages: only text content parts are supported")
            return "".join(parts)
        return self.content or ""


class FunctionDef(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class _NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: _NamedFunction


MAX_TOOLS = 128  # OpenAI's limit


class ChatRequest(_Common):
    messages: list[ChatMessageIn] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    # Only models that reason read it; the others ignore it (as OpenAI's non-reasoning models do).
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template (enable_thinking, ...)

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatRequest:
        choice = self.tool_choice
        if choice is None or choice == "none" or choice == "auto":
            return self
        names = [t.function.name for t in self.tools or []]
        if not names:
            raise ValueError("tool_choice: names a call but no tools are given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}; tools: {names}")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format: not with a forced tool call (tool_choice required or named)")
        return self

    def call_choice(self) -> tool_calls.Choice:
        """'none', 'auto', 'required' or the named function (OpenAI's default: auto with tools)."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        return choice.function.name if isinstance(choice, NamedToolChoice) else choice

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def template_extra(self) -> dict[str, Any]:
        """What the chat template reads beside the messages: the tools (unless tool_choice is none)
        and chat_template_kwargs."""
        extra = dict(self.chat_template_kwargs or {})
        if self.tools and self.call_choice() != "none":
            extra["tools"] = self.tool_dicts()
        return extra

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them: an assistant's tool call arguments as
        objects (OpenAI sends them as JSON text), as Hugging Face's templates expect."""
        out = []
        for m in self.messages:
            message = {**(m.model_extra or {}), "role": m.role, "content": m.text()}
            calls = message.get("tool_calls")
            if isinstance(calls, list):
                message["tool_calls"] = [_arguments_as_object(c) for c in calls]
            out.append(message)
        return out


def submit_for(
    body: CompletionRequest | ChatRequest,
    request_id: str,
    model: str | None,
    prompt_ids: list[int] | None,
    max_seq_len: int | None,
    lora: str | None = None,
    vocab_size: int | None = None,
) -> protocol.Submit:
    """The Submit for `body`, with `prompt_ids` when the caller tokenized it, under the LoRA
    adapter `lora` if given; raises ValueError (or ValidationError) for a bad parameter.
    `vocab_size` (the model's) is needed for a logit_bias only."""
    chat = isinstance(body, ChatRequest)
    max_tokens = (body.max_completion_tokens if isinstance(body, ChatRequest) else None) or body.max_tokens
    if max_tokens == 0:
        max_tokens = 1  # the prompt alone: one token is generated and left out of the answer
    if max_tokens is None:
        # OpenAI's defaults: 16 for completions; a chat may fill the context.
        room = None if max_seq_len is None or prompt_ids is None else max_seq_len - len(prompt_ids)
        max_tokens = max(1, room) if chat and room is not None else 16 if not chat else 512
    sampling = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "min_tokens": body.min_tokens,
        **body.extra_sampling(),
    }
    beams = int(sampling.get("beam_width") or 1)
    if beams > 1 and body.stream:
        raise ValueError("stream: beam search (beam_width > 1) is not streamed over HTTP")
    if isinstance(body, ChatRequest):
        top_n, want_logprobs = body.top_logprobs or 0, body.logprobs
    else:
        top_n, want_logprobs = body.logprobs or 0, body.logprobs is not None
    fields: dict[str, Any] = {
        "request_id": request_id,
        "model": model,
        "max_tokens": max_tokens,
        "streaming": body.stream,
        "sampling_config": sampling,
        "output_config": {"return_log_probs": want_logprobs, "top_n_log_probs": top_n,
                          "prompt_log_probs": None if isinstance(body, ChatRequest) else _prompt_top_n(body)},
        "end_id": -1 if body.ignore_eos else None,
        "stop": body.stops(),
        "num_return_sequences": body.n,
        "guided_decoding_params": _chat_guide(body) if isinstance(body, ChatRequest) else _regex_guide(body),
        "lora_config": None if lora is None else {"name": lora},
        "embedding_bias": None if not body.logit_bias else _dense_bias(body.logit_bias, vocab_size),
    }
    if prompt_ids is not None:
        fields["input_token_ids"] = prompt_ids
    elif isinstance(body, ChatRequest):
        if body.template_extra():
            raise ValueError("tools: the model's tokenizer is not loaded yet (no worker ready); retry")
        fields["messages"] = [{"role": m.role, "content": m.text()} for m in body.messages]
    elif isinstance(body.prompt, str):
        fields["prompt"] = body.prompt
    else:
        fields["input_token_ids"] = body.prompt
    return protocol.Submit.model_validate(fields)


def _prompt_top_n(body: CompletionRequest) -> int | None:
    """How many likeliest tokens each prompt position reports; None: the prompt's log probs are not needed."""
    echoed = body.logprobs if body.echo else None
    if echoed is None and body.prompt_logprobs is None:
        return None
    return max(echoed or 0, body.prompt_logprobs or 0)


def echo_for(body: CompletionRequest, prompt_ids: list[int] | None, tokenizer: Any) -> Echo | None:
    """What the request's choices repeat of its prompt, if anything."""
    if not body.echo and body.prompt_logprobs is None:
        return None
    if prompt_ids is None or tokenizer is None:
        raise ValueError("echo: the model's tokenizer is not loaded yet (no worker ready); retry")
    text = None
    if body.echo:
        text = body.prompt if isinstance(body.prompt, str) else str(tokenizer.decode(prompt_ids))
    return Echo(text, prompt_ids, body.echo and body.logprobs is not None, body.prompt_logprobs is not None)


def _dense_bias(logit_bias: dict[str, float], vocab_size: int | None) -> list[float]:
    """OpenAI's sparse logit_bias as the executor's embedding_bias: a value for every token
    (packed float32 on the wire: 4 bytes a token of the vocabulary)."""
    if vocab_size is None:
        raise ValueError("logit_bias: the model's vocabulary is not known yet (no worker ready); retry")
    bias = [0.0] * vocab_size
    for key, value in logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias: keys are token ids, got {key!r}") from None
        if not 0 <= token < vocab_size:
            raise ValueError(f"logit_bias: token id {token} is outside the vocabulary (size {vocab_size})")
        bias[token] = value
    return bias


def _chat_guide(body: ChatRequest) -> dict[str, Any] | None:
    """A forced tool call's schema, the response format's, or guided_regex."""
    schema = tool_calls.forced_schema(body.tool_dicts(), body.call_choice(), body.parallel_tool_calls)
    guides = [g for g in ({"guide_type": "json_schema", "guide": json.dumps(schema)} if schema is not None else None,
                          _guide(body.response_format), _regex_guide(body)) if g is not None]  # fmt: skip
    if len(guides) > 1:
        raise ValueError("guided_regex: not with response_format or a forced tool call (one guide a request)")
    return guides[0] if guides else None


def _regex_guide(body: _Common) -> dict[str, Any] | None:
    return None if body.guided_regex is None else {"guide_type": "regex", "guide": body.guided_regex}


def _guide(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"guide_type": "json"}
    if fmt.json_schema is None:
        raise ValueError("response_format: json_schema needs a json_schema object")
    return {"guide_type": "json_schema", "guide": json.dumps(fmt.json_schema.schema_)}


def finish_reason(reason: FinishReason | int | None) -> str | None:
    if reason is None or reason == FinishReason.NOT_FINISHED:
        return None
    return "length" if reason in (FinishReason.LENGTH, FinishReason.TIMED_OUT) else "stop"


@dataclass(slots=True)
class Choice:
    """One returned sequence, as it builds up."""

    index: int
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    # (token id, log prob, [(top token id, log prob), ...]) per generated token.
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_log_probs: protocol.PromptLogProbs | None = None  # the worker's, when asked for


def logprob_entries(result: protocol.Result, beam: int = 0) -> list[tuple[int, float, list[tuple[int, float]]]]:
    if result.log_probs is None:
        return []
    ids = result.output_token_ids[beam]
    tops: list[list[tuple[int, float]]] = [[] for _ in ids]
    if result.top_token_ids is not None and result.top_log_probs is not None:
        tops = [list(zip(t, p, strict=True)) for t, p in zip(result.top_token_ids[beam], result.top_log_probs[beam],
                                                             strict=True)]  # fmt: skip
    return [(int(t), float(lp), top) for t, lp, top in zip(ids, result.log_probs[beam], tops, strict=True)]


class TokenText:
    """Token ids to the strings OpenAI's log probs show (each token decoded alone)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))


def chat_logprobs(entries: list[tuple[int, float, list[tuple[int, float]]]], text: TokenText) -> dict[str, Any]:
    def one(token_id: int, lp: float) -> dict[str, Any]:
        s = text(token_id)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**one(t, lp), "top_logprobs": [one(tt, tlp) for tt, tlp in top]} for t, lp, top in entries]}


def completion_logprobs(entries: Sequence[Entry], text: TokenText, offset: int) -> dict[str, Any]:
    tokens = [text(t) for t, _, _ in entries]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [None if top is None else _by_text(top, text) for _, _, top in entries],
        "text_offset": offsets,
    }


def _echoed(c: Choice, echo: Echo, text: TokenText) -> dict[str, Any]:
    """A completion choice with its prompt repeated as asked."""
    prompt = prompt_entries(echo.token_ids, c.prompt_log_probs) if echo.with_log_probs or echo.prompt_logprobs else []
    entries: list[Entry] = [*(prompt if echo.with_log_probs else []), *c.logprobs]
    choice = {"index": c.index, "text": (echo.text or "") + c.text,
              "logprobs": completion_logprobs(entries, text, 0) if entries else None, "finish_reason": c.finish_reason}
    if echo.prompt_logprobs:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt, text)
    return choice


def _by_text(top: list[tuple[int, float]], text: TokenText) -> dict[str, float]:
    """OpenAI's top log probs, keyed by text: where two tokens decode alike, the likelier
    one's (a harness takes the largest value for the likeliest token's)."""
    out: dict[str, float] = {}
    for token, lp in top:
        out.setdefault(text(token), lp)
    return out


def usage(prompt_tokens: int | None, completion_tokens: int) -> dict[str, int]:
    p = prompt_tokens or 0
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


def whole_response(chat: bool, request_id: str, model: str, choices: list[Choice], prompt_tokens: int | None,
                   text: TokenText, echoes: list[Echo | None] | None = None,
                   rules: OutputRules | None = None) -> dict[str, Any]:  # fmt: skip
    """`echoes`: a completion's, one for each choice (its prompt's); `rules`: how a chat's
    output is read (reasoning, tool calls)."""
    out = []
    for c, echo in zip(choices, echoes or [None] * len(choices), strict=True):
        if echo is not None:
            out.append(_echoed(c, echo, text))
            continue
        if chat:
            lp = chat_logprobs(c.logprobs, text) if c.logprobs else None
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            reason = c.finish_reason
            if rules is not None:
                message, calls = rules.message(c.text)
                forced = rules.tools is not None and rules.tools.choice not in ("none", "auto")
                if calls and (reason == "stop" or forced):
                    reason = "tool_calls"
            out.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": reason})
        else:
            lp = completion_logprobs(c.logprobs, text, 0) if c.logprobs else None
            out.append({"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage(prompt_tokens, sum(c.tokens for c in choices)),
    }
