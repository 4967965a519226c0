"""The Responses API (/v1/responses) through the official `openai` SDK against real
gateways and a worker (processes, Redis, the tiny checkpoint): a conversation
continued across two gateways from Redis, streaming events, stored responses read
and deleted, outliving a gateway restart and expiring at --response-ttl, function calls
and their outputs."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from tests.procs import free_port, stack

openai = pytest.importorskip("openai")

MODEL = "tiny-llama-long"
FIXED = {"temperature": 0.0, "max_output_tokens": 6, "extra_body": {"min_tokens": 6}}


@pytest.fixture(scope="module")
def clients(long_model, redis_server, tmp_path_factory):
    ports = free_port(), free_port()
    with stack(long_model, redis_server.url, tmp_path_factory.mktemp("responses"), workers=0, gateways=0) as s:
        s.worker()
        for port in ports:
            s.gateway("--http-port", str(port))
        for g in s.gateways:
            g.wait_workers(1)
        made = [openai.OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="unused", max_retries=0, timeout=120)
                for p in ports]  # fmt: skip
        yield made
        for c in made:
            c.close()


def test_a_conversation_of_three_turns_through_two_gateways(clients):
    one, two = clients
    r1 = one.responses.create(model=MODEL, instructions="Answer briefly.", input="My name is Ada.", **FIXED)
    # max_output_tokens reached: incomplete, as OpenAI answers it.
    assert r1.status == "incomplete" and r1.incomplete_details.reason == "max_output_tokens"
    assert r1.id.startswith("resp_")
    assert r1.output[0].type == "message" and r1.output_text
    assert r1.usage.output_tokens == 6
    # The second gateway reads the first turn from Redis: its prompt holds it.
    r2 = two.responses.create(model=MODEL, previous_response_id=r1.id, input="What is my name?", **FIXED)
    alone = two.responses.create(model=MODEL, input="What is my name?", **FIXED)
    assert r2.previous_response_id == r1.id
    assert r2.usage.input_tokens > alone.usage.input_tokens + r1.usage.output_tokens
    # The third, streamed, through the first gateway again.
    stream = one.responses.create(model=MODEL, previous_response_id=r2.id, input="Spell it.", stream=True, **FIXED)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    r3 = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r3.output_text
    assert r3.usage.input_tokens > r2.usage.input_tokens + r2.usage.output_tokens
    # Stored: any gateway reads it, deletes it.
    assert two.responses.retrieve(r3.id).output_text == r3.output_text
    one.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        two.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError) as e:
        one.responses.create(model=MODEL, previous_response_id=r1.id, input="again", **FIXED)
    assert e.value.body["param"] == "previous_response_id"


def test_store_false_is_not_kept(clients):
    one, _ = clients
    r = one.responses.create(model=MODEL, input="hello", store=False, **FIXED)
    with pytest.raises(openai.NotFoundError):
        one.responses.retrieve(r.id)


def test_a_function_call_and_its_output(clients):
    pytest.importorskip("xgrammar")
    one, two = clients
    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "name": "get_weather", "parameters": params}]
    r = one.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, max_output_tokens=40,
                             tool_choice={"type": "function", "name": "get_weather"}, temperature=0.0)  # fmt: skip
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), params)
    follow = two.responses.create(model=MODEL, previous_response_id=r.id, tools=tools, tool_choice="none",
                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                          "output": "sunny"}], **FIXED)  # fmt: skip
    assert follow.output_text


def test_refusals_name_the_field(clients):
    one, _ = clients
    with pytest.raises(openai.BadRequestError) as e:
        one.responses.create(model=MODEL, input=[{"type": "image_generation_call"}], max_output_tokens=2)
    assert "input[0].type" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        one.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}], max_output_tokens=2)
    assert "tools" in e.value.body["message"]


def test_structured_output(clients):
    pytest.importorskip("xgrammar")
    one, _ = clients
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}  # fmt: skip
    r = one.responses.create(model=MODEL, input="yes or no?", max_output_tokens=40, temperature=0.0,
                             text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_stored_responses_outlive_their_gateway_and_expire(long_model, redis_server_factory, tmp_path):
    port = free_port()
    # A Redis of its own: the module's stack registers its worker under the same name in the shared one.
    with stack(long_model, redis_server_factory().url, tmp_path, workers=0, gateways=0) as s:
        s.worker()
        first = s.gateway("--http-port", str(port))  # the default: kept 30 days
        first.wait_workers(1)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            stored = c.responses.create(model=MODEL, input="My name is Ada.", **FIXED)
        first.stop()
        again = s.gateway("--http-port", str(port), "--response-ttl", "1")  # a restart, on the same port
        again.wait_workers(1)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            assert c.responses.retrieve(stored.id).output_text == stored.output_text
            follow_up = c.responses.create(model=MODEL, previous_response_id=stored.id, input="And?", **FIXED)
            assert follow_up.usage.input_tokens > stored.usage.input_tokens + stored.usage.output_tokens
            assert s.redis.ttl(s.keys.response(follow_up.id)) <= 1  # this gateway's --response-ttl
            assert s.redis.ttl(s.keys.response(stored.id)) > 3600  # the first one's
            time.sleep(1.5)
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve(follow_up.id)
            assert c.responses.retrieve(stored.id).id == stored.id
