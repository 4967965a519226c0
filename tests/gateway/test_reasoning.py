"""Reasoning split from content on fixed strings, whole and streamed in pieces, and
with tool calls after it (gateway/chat_output.py)."""

from __future__ import annotations

import json

import pytest

from gateway import reasoning
from gateway.chat_output import ChatStream, OutputRules
from protocol.tool_calls import ToolUse


@pytest.mark.parametrize(("parser", "text", "thought", "content"), [
    ("think", "<think>\nsome thought\n</think>\n\nThe answer.", "\nsome thought\n", "The answer."),
    ("think", "No thinking here.", None, "No thinking here."),
    ("think", "<think>cut off", "cut off", ""),
    ("deepseek_r1", "thought first</think>answer", "thought first", "answer"),
    ("deepseek_r1", "<think>a</think>b", "a", "b"),
])  # fmt: skip
def test_split(parser: str, text: str, thought: str | None, content: str) -> None:
    assert reasoning.split(parser, text) == (thought, content)
    for size in (1, 2, 5):
        s = reasoning.ReasoningStream(parser)
        pieces = [p for i in range(0, len(text), size) for p in s.feed(text[i : i + size])] + s.finish()
        got_thought = "".join(t for kind, t in pieces if kind == "reasoning_content")
        assert got_thought == (thought or "")
        assert "".join(t for kind, t in pieces if kind == "content") == content
        assert all("<think>" not in t and "</think>" not in t for _, t in pieces)


def test_the_parser_follows_the_chat_template() -> None:
    assert reasoning.parser_for("{{ '<think>' }}...{{ '</think>' }}", None) == "think"
    assert reasoning.parser_for("plain", None) is None
    assert reasoning.parser_for("plain", "deepseek_r1") == "deepseek_r1"


def test_reasoning_then_a_tool_call_streamed() -> None:
    text = '<think>I should call it.</think>\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    rules = OutputRules(ToolUse("hermes", "auto"), "think")
    message, calls = rules.message(text)
    assert message["reasoning_content"] == "I should call it." and message["content"] is None
    assert [c.name for c in calls] == ["f"]
    for size in (1, 4, 9):
        s = ChatStream(rules)
        deltas = [d for i in range(0, len(text), size) for d in s.feed(text[i : i + size])] + s.finish()
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should call it."
        assert "".join(d.get("content", "") for d in deltas) == ""
        parts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert parts[0]["function"]["name"] == "f" and parts[0]["id"].startswith("call_")
        assert json.loads("".join(p["function"]["arguments"] for p in parts)) == {"x": 1}
