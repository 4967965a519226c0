"""Tool calling through the ZeroMQ clients and the job queue, against real gateways and a
worker (processes, Redis, the tiny checkpoint): the gateway renders the tools with the
chat template, guides a forced call to the tools' schemas and reads the calls into the
final output; an embedding job and an OpenAI batch line for /v1/embeddings give what
Client.embed gives."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import numpy as np
import pytest

from clients.async_client import AsyncClient
from clients.client import Client
from clients.connection import RequestError
from clients.jobs import JobQueue, JobStatus
from tests.procs import CLIENT_OPTIONS, Proc, stack
from tests.tool_schemas import ASK, LLAMA_CALL, PARAMS, SCHEMAS, TIME, WEATHER

pytest.importorskip("xgrammar")



@pytest.fixture(scope="module")
def service(long_model, redis_server, tmp_path_factory):
    with stack(long_model, redis_server.url, tmp_path_factory.mktemp("client-tools"), workers=0, gateways=0) as s:
        s.worker()
        s.gateway()
        s.gateway("--tool-parser", "llama3_json")
        for g in s.gateways:
            g.wait_workers(1)
        yield s


@pytest.fixture(scope="module")
def client(service):
    with Client([service.gateways[0].endpoint], **CLIENT_OPTIONS) as c:
        yield c


def test_a_named_call_is_forced_and_validates(client):
    out = client.chat(ASK, tools=[WEATHER, TIME], tool_choice="get_weather", max_tokens=200, temperature=0.0,
                      timeout=120)  # fmt: skip
    (call,) = out.outputs[0].tool_calls or []
    assert call.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), PARAMS)
    assert out.text == ""  # a forced call's output is the call alone
    streamed = client.chat(ASK, tools=[WEATHER, TIME], tool_choice="get_weather", max_tokens=200,
                           temperature=0.0, streaming=True, timeout=120)  # fmt: skip
    (again,) = streamed.outputs[0].tool_calls or []
    assert json.loads(again.arguments) == json.loads(call.arguments)  # greedy: the same call
    assert json.loads(streamed.text, strict=False) == json.loads(call.arguments)  # streamed, the text went out raw


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_are_forced_and_validate(service, parallel):
    async def ask() -> Any:
        async with AsyncClient([service.gateways[0].endpoint], **CLIENT_OPTIONS) as c:
            return await c.chat(ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel,
                                max_tokens=400, temperature=0.0, timeout=120)  # fmt: skip

    calls = asyncio.run(ask()).outputs[0].tool_calls
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_calls_the_model_writes_are_read_in_the_gateways_format(service):
    with Client([service.gateways[1].endpoint], **CLIENT_OPTIONS) as c:  # --tool-parser llama3_json
        out = c.chat(ASK, tools=[WEATHER], guided_json=LLAMA_CALL, max_tokens=200, temperature=0.0, timeout=120)
        plain = c.chat(ASK, guided_json=LLAMA_CALL, max_tokens=200, temperature=0.0, timeout=120)
    (call,) = out.outputs[0].tool_calls or []
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMS)
    assert out.text == ""
    # Without tools the same output is text, and nothing is read as a call.
    assert plain.outputs[0].tool_calls is None
    assert json.loads(plain.text, strict=False)["parameters"] == json.loads(call.arguments)


def test_a_tool_result_turn_is_answered_and_bad_arguments_are_named(client):
    called = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]}  # fmt: skip
    messages = [*ASK, called, {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    out = client.chat(messages, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0.0, timeout=120)
    assert out.outputs[0].tool_calls is None and len(out.token_ids) > 0
    broken = {**called, "tool_calls": [{"id": "call_1", "function": {"name": "get_weather", "arguments": "{oops"}}]}
    with pytest.raises(RequestError, match=r"call_1.*not JSON"):
        client.chat([*ASK, broken], max_tokens=2, timeout=120)
    assert client.chat(ASK, max_tokens=2, timeout=120).token_ids  # the gateway serves on


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tools": [WEATHER], "tool_choice": "nope"}, "tool_choice 'nope'"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_json": True}, "not with a forced tool call"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools: each is"),
])  # fmt: skip
def test_tool_refusals_name_the_field(client, kwargs, match):
    with pytest.raises(ValueError, match=match):
        client.chat(ASK, max_tokens=2, timeout=120, **kwargs)


def test_jobs_carry_tool_calls_and_embeddings(service, tmp_path):
    consumer = Proc("consumer", "clients.cli", ["jobs", "consume", "--gateway", service.gateways[0].endpoint,
                                                "--redis", service.redis_url], tmp_path)  # fmt: skip
    try:
        with JobQueue(service.redis_url) as q, Client([service.gateways[0].endpoint], **CLIENT_OPTIONS) as c:
            call_job = q.submit_many([{"messages": ASK, "tools": [WEATHER], "tool_choice": "get_weather",
                                       "max_tokens": 200, "temperature": 0.0}])[0]  # fmt: skip
            embed_job = q.submit("Paris in spring", embedding={})
            called, embedded = (q.result(job, timeout=120) for job in (call_job, embed_job))
            expected = c.embed("Paris in spring", timeout=120)[0]
        assert called.status == JobStatus.DONE
        (call,) = called.outputs[0].tool_calls or []
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), PARAMS)
        assert embedded.status == JobStatus.DONE
        vector = np.asarray(embedded.outputs[0].embedding, np.float32)
        np.testing.assert_array_equal(vector, expected)  # the same request, the same worker: the same bits
    finally:
        consumer.stop()
