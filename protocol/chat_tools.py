"""A chat with tools, as a Submit states it: the tools and the turns that made or
answered calls as chat templates read them, the guide a forced call is held to, and the
calls read from the whole output (the formats: protocol/tool_calls.py). The gateway
applies it for ZeroMQ clients and jobs, the in-process LLM for its own chats; the HTTP
front does the same from OpenAI's JSON (gateway/openai_api.py, gateway/chat_output.py)."""

from __future__ import annotations

import json
from typing import Any

from protocol import tool_calls
from protocol.request import ChatMessage, GuidedDecodingParams, Submit, ToolSpec
from protocol.results import FunctionCall
from protocol.tool_calls import ToolUse


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The turns as templates read them: a call's arguments as an object, OpenAI's shape."""
    out = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": _arguments(c)}}
                                  for c in m.tool_calls]  # fmt: skip
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        out.append(turn)
    return out


def _arguments(call: FunctionCall) -> Any:
    try:
        return json.loads(call.arguments)
    except ValueError:
        raise ValueError(f"messages: tool call {call.id!r}: arguments are not JSON: {call.arguments[:80]!r}") from None


def _choice(submit: Submit) -> str:
    return submit.tool_choice or ("auto" if submit.tools else "none")


def openai_tools(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    """The tools as OpenAI's `tools` entries (what templates and the guide read)."""
    out = []
    for t in tools:
        function: dict[str, Any] = {"name": t.name}
        if t.description is not None:
            function["description"] = t.description
        if t.parameters is not None:
            try:
                function["parameters"] = json.loads(t.parameters)
            except ValueError:
                raise ValueError(f"tools: the parameters of {t.name!r} are not JSON") from None
        out.append({"type": "function", "function": function})
    return out


def template_extra(submit: Submit) -> dict[str, Any] | None:
    """The template's `tools` variable, unless the chat's tool_choice is none."""
    if not submit.tools or _choice(submit) == "none":
        return None
    return {"tools": openai_tools(submit.tools)}


def forced_guide(submit: Submit) -> str | None:
    """The JSON schema (text) a forced call's output is guided by; None when no call is
    forced. ValueError names what is wrong with the tools."""
    if not submit.tools:
        return None
    schema = tool_calls.forced_schema(openai_tools(submit.tools), _choice(submit), submit.parallel_tool_calls)
    return None if schema is None else json.dumps(schema)


def with_guide(submit: Submit) -> Submit:
    """`submit` guided to the tools' schemas when a call is forced."""
    guide = forced_guide(submit)
    if guide is None:
        return submit
    return submit.model_copy(update={"guided_decoding_params": GuidedDecodingParams(guide_type="json_schema",
                                                                                     guide=guide)})  # fmt: skip


def tool_use(submit: Submit, chat_template: str | None, configured: str | None) -> ToolUse | None:
    """How the chat's output is read for calls; None when it is not."""
    choice = _choice(submit)
    return None if choice == "none" else ToolUse(tool_calls.parser_for(chat_template, configured), choice)


def read_calls(use: ToolUse, whole_text: str) -> tuple[str, list[FunctionCall]] | None:
    """(the content outside the calls, the calls) of a whole output; None when it made none."""
    content, calls = use.whole(whole_text)
    if not calls:
        return None
    return content or "", [FunctionCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]
