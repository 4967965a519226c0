"""Tool-call parsers and the streaming splitter on fixed strings."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from protocol import tool_calls as tc

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
               '{"x": 1}}</tool_call>', None, [("a", {}), ("b", {"x": 1})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"k": "v"}}', None, [("a", {"k": "v"})]),  # no closing tag
    ("hermes", "no call here", "no call here", []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo; Norway"}}', None,
     [("get_weather", {"city": "Oslo; Norway"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"q": "}"}}', None,
     [("a", {}), ("b", {"q": "}"})]),
    ("llama3_json", 'The answer is {"name": 1}', 'The answer is {"name": 1}', []),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"n": 2}}]', None, [("a", {"n": 2})]),
    ("mistral", '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]', None, [("a", {}), ("b", {})]),
])  # fmt: skip
def test_parsers(parser: str, text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    got_content, got = tc.parse(parser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


@pytest.mark.parametrize(("template", "want"), [
    ("{{ '<tool_call>' }}", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"), (None, "hermes"),
])  # fmt: skip
def test_the_parser_follows_the_chat_template(template: str | None, want: str) -> None:
    assert tc.parser_for(template, None) == want
    assert tc.parser_for(template, "mistral") == "mistral"


def _stream(parser: str, choice: tc.Choice, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """(content, the calls as a client assembles them from the deltas)."""
    s = tc.ToolStream(parser, choice)
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for part in d.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"function": {"name": "", "arguments": ""}, "parts": 0})
            call["parts"] += 1
            if "id" in part:
                assert call["parts"] == 1, "the id and name come first"
                call["id"] = part["id"]
            call["function"]["name"] += part["function"].get("name", "")
            call["function"]["arguments"] += part["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def test_streaming_never_sends_call_text_as_content() -> None:
    text = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for size in (1, 3, 7):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        content, calls = _stream("hermes", "auto", pieces)
        assert content == "Checking."
        assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    # Held back while it might begin a call, sent once it cannot.
    content, calls = _stream("hermes", "auto", ["a <tool", "_cal", "l? no"])
    assert (content, calls) == ("a <tool_cal" + "l? no", [])
    content, calls = _stream("llama3_json", "auto", ["{", '"na', "ive", '": 1}'])
    assert (content, calls) == ('{"naive": 1}', [])


def test_a_forced_named_call_streams_its_arguments() -> None:
    s = tc.ToolStream("hermes", "get_weather")
    deltas = [d["tool_calls"][0] for p in ['{"ci', 'ty": "Par', 'is"}'] for d in s.feed(p)] + s.finish()
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and "id" in deltas[0]
    assert [d["function"]["arguments"] for d in deltas[1:]] == ['{"ci', 'ty": "Par', 'is"}']  # as they come
    assert all(d["index"] == 0 for d in deltas)


def test_forced_schemas_validate_what_parse_forced_reads() -> None:
    tools = [WEATHER, TIME]
    schema = tc.forced_schema(tools, "required", parallel=True)
    assert schema is not None
    out = [{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"city": "X"}}]
    jsonschema.validate(out, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "X"}}], schema)
    one = tc.forced_schema(tools, "required", parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(out, one)
    assert [c.name for c in tc.parse_forced("required", json.dumps(out))] == ["get_time", "get_weather"]
    assert tc.forced_schema(tools, "get_weather", parallel=True) == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert tc.forced_schema(tools, "auto", parallel=True) is None


def test_control_characters_in_strings_are_escaped_across_fragments() -> None:
    escape = tc.JsonEscaper()
    text = '{"a": "x\x1dy\\"\n", \n"b": 1}'
    out = "".join(escape(text[i : i + 2]) for i in range(0, len(text), 2))
    assert json.loads(out) == {"a": 'x\x1dy"\n', "b": 1}  # strict: valid JSON
    (call,) = tc.parse("hermes", '<tool_call>{"name": "f", "arguments": {"s": "a\x01b"}}</tool_call>')[1]
    assert json.loads(call.arguments) == {"s": "a\x01b"}
