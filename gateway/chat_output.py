"""A chat's output as OpenAI answers it: reasoning apart from content
(gateway/reasoning.py), then tool calls out of the content (gateway/tool_calls.py),
for a whole message or a stream of deltas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway import reasoning
from protocol.tool_calls import ToolCall, ToolStream, ToolUse


@dataclass(frozen=True, slots=True)
class OutputRules:
    """How one chat request's output is read."""

    tools: ToolUse | None  # None: no tools in play (none given, or tool_choice none)
    reasoning: str | None  # the reasoning parser; None: all content

    def message(self, text: str) -> tuple[dict[str, Any], list[ToolCall]]:
        """The assistant message of a whole output, and its calls."""
        thought, content = reasoning.split(self.reasoning, text) if self.reasoning else (None, text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thought is not None:
            message["reasoning_content"] = thought
        calls: list[ToolCall] = []
        if self.tools is not None:
            message["content"], calls = self.tools.whole(content)
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
        return message, calls


class ChatStream:
    """One streamed choice's deltas: reasoning_content, content, tool_calls."""

    def __init__(self, rules: OutputRules) -> None:
        self.thinking = None if rules.reasoning is None else reasoning.ReasoningStream(rules.reasoning)
        self.tools = None if rules.tools is None else ToolStream(rules.tools.parser, rules.tools.choice)

    @property
    def calls(self) -> list[ToolCall]:
        return [] if self.tools is None else self.tools.calls

    @property
    def forced(self) -> bool:
        return self.tools is not None and self.tools.forced

    def feed(self, delta: str) -> list[dict[str, Any]]:
        return self._route(self.thinking.feed(delta) if self.thinking is not None else [("content", delta)])

    def finish(self) -> list[dict[str, Any]]:
        out = self._route(self.thinking.finish()) if self.thinking is not None else []
        return out + (self.tools.finish() if self.tools is not None else [])

    def _route(self, pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in pieces:
            if kind == "reasoning_content" or self.tools is None:
                out.append({kind: text})
            else:
                out += self.tools.feed(text)
        return out
