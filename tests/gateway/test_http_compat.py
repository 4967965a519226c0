"""What OpenAI's applications send beyond the basic calls, through the official
`openai` SDK against a real gateway and worker (processes, Redis, the tiny
checkpoint): fields that change nothing here, errors in OpenAI's shape on every
route, echo and prompt log probs."""

from __future__ import annotations

import pytest

from tests.procs import free_port, stack

openai = pytest.importorskip("openai")

MODEL = "tiny-llama-long"


@pytest.fixture(scope="module")
def service(long_model, redis_server, tmp_path_factory):
    port = free_port()
    with stack(long_model, redis_server.url, tmp_path_factory.mktemp("compat"), workers=0, gateways=0) as s:
        s.worker()
        s.gateway("--http-port", str(port))
        s.gateways[0].wait_workers(1)
        s.http_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
        yield s


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=f"{service.http_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_fields_that_change_nothing_are_accepted(client):
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0.0)
    ignored = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0.0,
                                             store=False, metadata={"app": "test"}, user="someone",
                                             service_tier="auto", reasoning_effort="low")  # fmt: skip
    assert ignored.choices[0].message.content == plain.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, user="someone",
                                     extra_body={"metadata": {"a": "b"}})  # fmt: skip
    assert comp.choices[0].text is not None


def test_unknown_parameter_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body={"frobnicate": 1})  # fmt: skip
    assert e.value.body["param"] == "frobnicate"
    assert "frobnicate" in e.value.body["message"]


def test_unknown_routes_and_methods_answer_in_openais_shape(client):
    with pytest.raises(openai.NotFoundError) as e404:
        client.get("/no/such/route", cast_to=object)
    assert e404.value.body["type"] == "not_found_error"
    assert "/v1/no/such/route" in e404.value.body["message"]
    with pytest.raises(openai.APIStatusError) as e405:
        client.get("/completions", cast_to=object)
    assert e405.value.status_code == 405
    assert e405.value.body["type"] == "invalid_request_error"
    assert "GET" in e405.value.body["message"]
