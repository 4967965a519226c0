"""OpenAI's Responses API (/v1/responses) in terms of the chat API: a request's
input items, instructions and tools become a chat request; a chat's answer becomes
a response object (output items: message, function calls) and, streamed, the
Responses API's events. No I/O here (gateway/http_front.py serves it,
gateway/response_store.py keeps stored responses in Redis).

A follow-up (`previous_response_id`) continues the stored conversation: the earlier
turns' messages, without their instructions (as OpenAI does), then the new input.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway import openai_api as api

# Fields of a request that change nothing here.
_IGNORED = ("metadata", "user", "service_tier", "reasoning", "truncation", "include", "prompt_cache_key",
            "safety_identifier", "background")  # fmt: skip


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """The Responses API's structured output: text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        """As the chat API's response_format."""
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None:
            raise ValueError("text.format: json_schema needs a schema")
        return {"type": "json_schema", "json_schema": {"name": self.name or "output", "schema": self.schema_,
                                                       "strict": self.strict}}  # fmt: skip


class TextConfig(BaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(BaseModel):
    """Unknown fields are tokenwire's sampling options, checked as the chat API checks them."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None

    def chat(self, earlier: list[dict[str, Any]]) -> api.ChatRequest:
        """The chat request this one runs as, after the `earlier` turns' messages."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if k not in _IGNORED}
        fields: dict[str, Any] = {"model": self.model, "messages": self.messages(earlier), "stream": self.stream,
                                  "max_completion_tokens": self.max_output_tokens,
                                  "parallel_tool_calls": self.parallel_tool_calls, **extra}  # fmt: skip
        if self.temperature is not None:
            fields["temperature"] = self.temperature
        if self.top_p is not None:
            fields["top_p"] = self.top_p
        if self.text is not None:
            fields["response_format"] = self.text.format.response_format()
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]  # fmt: skip
        if isinstance(self.tool_choice, NamedFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        return api.ChatRequest.model_validate(fields)

    def messages(self, earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return system + earlier + self.input_messages()

    def input_messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages (consecutive function calls: one assistant turn)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise ValueError(f"input[{i}].role: user, assistant, system or developer, got {role!r}")
                out.append({"role": "system" if role == "developer" else role, "content": _text(item, i)})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}  # fmt: skip
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output"))})
            elif kind != "reasoning":  # a model's reasoning is not read back
                raise ValueError(f"input[{i}].type: {kind!r} is not supported (message, function_call, "
                                 "function_call_output)")
        return out


def _text(item: dict[str, Any], i: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"input[{i}].content: text or a list of text parts")
    parts = [p.get("text", "") for p in content if isinstance(p, dict)
             and p.get("type") in ("input_text", "output_text", "text")]  # fmt: skip
    if len(parts) != len(content):
        raise ValueError(f"input[{i}].content: only text parts are supported")
    return "".join(parts)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict[str, Any], status: str = "completed") -> list[dict[str, Any]]:
    """A chat answer's message as the Responses API's output items."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": new_id("rs"), "status": status, "summary": [],
                      "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})  # fmt: skip
    if message.get("content"):
        items.append({"type": "message", "id": new_id("msg"), "status": status, "role": "assistant",
                      "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})  # fmt: skip
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "status": status,
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"]})  # fmt: skip
    return items


def response_object(response_id: str, body: ResponsesRequest, model: str, output: list[dict[str, Any]],
                    usage: dict[str, int] | None, finish_reason: str | None,
                    status: str = "completed") -> dict[str, Any]:  # fmt: skip
    """The response object the SDK reads (`output_text` gathers the message's text)."""
    if status == "completed" and finish_reason == "length":
        status = "incomplete"
    used = usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
        "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "previous_response_id": body.previous_response_id,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction)
                        else body.tool_choice or "auto"),
        "parallel_tool_calls": body.parallel_tool_calls, "temperature": body.temperature, "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens, "store": body.store, "metadata": body.metadata or {},
        "text": {"format": (body.text or TextConfig()).format.model_dump(by_alias=True, exclude_none=True)},
        "usage": {"input_tokens": used["prompt_tokens"], "output_tokens": used["completion_tokens"],
                  "total_tokens": used["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }  # fmt: skip


def conversation_after(messages: list[dict[str, Any]], message: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation a stored response ends: its turns (without instructions) and its answer."""
    turn = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    return [*messages, turn]


class ResponseEvents:
    """One streamed response's server-sent events, numbered as the SDK reads them: the
    message's text deltas as they come; reasoning and function calls as whole items
    once the output has ended."""

    def __init__(self, response_id: str, body: ResponsesRequest, model: str) -> None:
        self.id, self.body, self.model = response_id, body, model
        self.seq = 0
        self.message_id = new_id("msg")
        self.opened = False  # the message item has begun
        self.reasoned = False  # reasoning came first: the message is output item 1
        self.text = ""

    def _event(self, type_: str, **fields: Any) -> str:
        self.seq += 1
        data = json.dumps({"type": type_, "sequence_number": self.seq, **fields}, separators=(",", ":"))
        return f"event: {type_}\ndata: {data}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": int(self.reasoned), "content_index": 0}

    def start(self) -> str:
        response = response_object(self.id, self.body, self.model, [], None, None, status="in_progress")
        return self._event("response.created", response=response) + self._event("response.in_progress",
                                                                                  response=response)

    def piece(self, delta: dict[str, Any]) -> str:
        """The events of one of a chat stream's deltas."""
        if delta.get("reasoning_content"):
            self.reasoned = self.reasoned or not self.opened
            return ""
        text = delta.get("content")
        if not text:
            return ""  # tool_calls deltas: the calls go whole at the end
        out = ""
        if not self.opened:
            self.opened = True
            item = {"type": "message", "id": self.message_id, "status": "in_progress", "role": "assistant",
                    "content": []}  # fmt: skip
            out += self._event("response.output_item.added", output_index=int(self.reasoned), item=item)
            out += self._event("response.content_part.added", **self._where(),
                               part={"type": "output_text", "text": "", "annotations": []})  # fmt: skip
        self.text += text
        return out + self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])

    def end(self, message: dict[str, Any], usage: dict[str, int],
            finish_reason: str | None) -> tuple[str, dict[str, Any]]:  # fmt: skip
        """The closing events and the final response object."""
        items = output_items(message)
        for item in items:
            if item["type"] == "message":
                item["id"] = self.message_id  # the streamed one
        out = ""
        if self.opened:
            if not any(item["type"] == "message" for item in items):
                items.insert(int(self.reasoned), output_items({"content": self.text})[0] | {"id": self.message_id})
            part = {"type": "output_text", "text": self.text, "annotations": []}
            out += self._event("response.output_text.done", **self._where(), text=self.text, logprobs=[])
            out += self._event("response.content_part.done", **self._where(), part=part)
        for i, item in enumerate(items):
            if not (item["type"] == "message" and self.opened):
                out += self._event("response.output_item.added", output_index=i, item={**item, "status": "in_progress"})
            if item["type"] == "function_call":
                out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                   arguments=item["arguments"])  # fmt: skip
            out += self._event("response.output_item.done", output_index=i, item=item)
        response = response_object(self.id, self.body, self.model, items, usage, finish_reason)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return out + self._event(kind, response=response), response

    def error(self, message: str) -> str:
        return self._event("error", code="server_error", message=message, param=None)
