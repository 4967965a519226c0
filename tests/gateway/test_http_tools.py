"""Tool calling on /v1/chat/completions through the official `openai` SDK, against
real gateways and a worker (processes, Redis, the tiny checkpoint): forced calls
guided to the tools' schemas, calls the model writes in its own format (here
Llama 3's JSON, which a JSON-schema response format makes the random model
write), streamed and not, a conversation with a tool's result, and reasoning split
from content (guided_regex makes the random model write the tags)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tests.procs import free_port, stack
from tests.tool_schemas import ASK, LLAMA_CALL, SCHEMAS, TIME, WEATHER

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

MODEL = "tiny-llama-long"
# A JSON-schema response format holding the random model to Llama 3's call format.
LLAMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "call", "schema": LLAMA_CALL}}


@pytest.fixture(scope="module")
def service(long_model, redis_server, tmp_path_factory):
    ports = free_port(), free_port()
    with stack(long_model, redis_server.url, tmp_path_factory.mktemp("tools"), workers=0, gateways=0) as s:
        s.worker()
        s.gateway("--http-port", str(ports[0]))
        s.gateway("--http-port", str(ports[1]), "--tool-parser", "llama3_json", "--reasoning-parser", "think")
        for g in s.gateways:
            g.wait_workers(1)
        s.urls = [f"http://127.0.0.1:{p}/v1" for p in ports]  # type: ignore[attr-defined]
        yield s


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=service.urls[0], api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def llama_client(service):
    with openai.OpenAI(base_url=service.urls[1], api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _valid(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"
    return args


def _streamed(stream) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """(content, calls by index as {id, name, arguments}, finish reason) of a streamed chat."""
    content, reason = "", None
    calls: dict[int, dict[str, str]] = {}
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id or ""
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        reason = choice.finish_reason or reason
    return content, calls, reason


def test_a_named_call_is_forced_and_validates(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                       max_tokens=200, temperature=0.0)  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    args = _valid(call)
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    content, calls, reason = _streamed(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200, temperature=0.0,
        stream=True))  # fmt: skip
    assert content == "" and reason == "tool_calls"
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == args  # greedy: the same call


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_are_forced_and_validate(client, parallel):
    kw = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 400,
          "temperature": 0.0, "parallel_tool_calls": parallel}  # fmt: skip
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        _valid(call)
    content, streamed, reason = _streamed(client.chat.completions.create(**kw, stream=True))
    assert content == "" and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_calls_the_model_writes_are_read_streamed_or_not(llama_client):
    kw = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 200, "temperature": 0.0,
          "response_format": LLAMA_FORMAT}  # fmt: skip
    r = llama_client.chat.completions.create(**kw)
    message = r.choices[0].message
    (call,) = message.tool_calls
    args = _valid(call)
    assert message.content is None and r.choices[0].finish_reason == "tool_calls"
    content, calls, reason = _streamed(llama_client.chat.completions.create(**kw, stream=True))
    assert content == "", "the call's text leaked into content"
    assert reason == "tool_calls" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == args
    # Without tools the same output is content.
    plain = llama_client.chat.completions.create(**{k: v for k, v in kw.items() if k != "tools"})
    # strict=False: the tiny model's guided strings hold raw control characters (escaped in calls' arguments).
    assert json.loads(plain.choices[0].message.content, strict=False)["name"] == "get_weather"
    assert not plain.choices[0].message.tool_calls


def test_a_tool_result_turn_is_answered(client):
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0.0)  # fmt: skip
    assert r.choices[0].message.tool_calls is None
    longer = [*messages[:-1], {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C, light wind"}]
    r2 = client.chat.completions.create(model=MODEL, messages=longer, max_tokens=1, temperature=0.0)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the tool's result is in the prompt


def test_tool_refusals_name_the_field(client):
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
    ]  # fmt: skip
    for kw, field in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, **kw)
        assert field in e.value.body["message"]


def test_reasoning_is_split_from_content(llama_client):
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 60, "temperature": 0.0,
          "extra_body": {"guided_regex": "<think>[a-z]{3,8}</think>\n[a-z]{3,8}"}}  # fmt: skip
    r = llama_client.chat.completions.create(**kw)
    message = r.choices[0].message
    thought, content = message.model_extra["reasoning_content"], message.content
    assert thought.isalpha() and content.isalpha(), (thought, content)
    chunks = list(llama_client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == content  # no tag, no thought in content


def test_reasoning_then_a_call(llama_client):
    call = r'<think>[a-z]{3,8}</think>\{"name": "get_weather", "parameters": \{"city": "[a-z]{1,8}", "days": [1-9]\}\}'
    kw = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 80, "temperature": 0.0,
          "extra_body": {"guided_regex": call}}  # fmt: skip
    r = llama_client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"].isalpha() and not message.content
    (tool_call,) = message.tool_calls
    _valid(tool_call)
    content, calls, reason = _streamed(llama_client.chat.completions.create(**kw, stream=True))
    assert content == "" and reason == "tool_calls"
    assert json.loads(calls[0]["arguments"]) == json.loads(tool_call.function.arguments)
