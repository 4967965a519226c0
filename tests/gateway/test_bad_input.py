"""Bad input at the gateway's client socket: each kind gets a clear error reply
(where a reply is possible) and the gateway and worker keep serving others."""

from __future__ import annotations

import os
from typing import Any

import msgpack
import pytest

import protocol
from clients.client import Client, RequestError
from tests.integration.wire import WireClient
from tests.procs import CLIENT_OPTIONS, stack


@pytest.fixture(scope="module")
def service(service_model, redis_server, tmp_path_factory):
    with stack(service_model, redis_server.url, tmp_path_factory.mktemp("bad_input")) as s:
        yield s


@pytest.fixture
def wire(service):
    c = WireClient(service.gateways[0].endpoint)
    c.hello()
    yield c
    c.close()


def _still_serving(service) -> None:
    with Client([service.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        assert len(client.generate([5, 6, 7], max_tokens=4, timeout=30).token_ids) == 4
    for p in [*service.workers, *service.gateways]:
        assert p.alive, p.log()[-2000:]


def _packed(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


GARBAGE = {
    "random bytes": os.urandom(256),
    "truncated msgpack": _packed([1, "submit", {"request_id": "x"}])[:-3],
    "a map, not an envelope": _packed({"kind": "submit"}),
    "a short envelope": _packed([1, "submit"]),
    "unknown version": _packed([99, "submit", {}]),
    "unknown kind": _packed([1, "launch_missiles", {}]),
    "payload not a map": _packed([1, "submit", [1, 2, 3]]),
    "nesting bomb": _packed([1, "submit", {"request_id": "n", "bad_words": [[[[[[[[[[1]]]]]]]]]]}]),
    "oversize frame": b"\x00" * (protocol.DEFAULT_LIMITS.max_message_bytes + 1),
}


@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_gets_a_protocol_error(service, wire, name):
    wire.send_raw(GARBAGE[name])
    reply = wire.wait_error()
    assert reply.code == protocol.ErrorCode.PROTOCOL
    assert reply.message
    _still_serving(service)


def test_extra_frames_get_an_error(service, wire):
    wire.send_raw(b"one", b"two")
    assert "one frame" in wire.wait_error().message
    _still_serving(service)


VALID = {"request_id": "bad", "input_token_ids": [5, 6, 7], "max_tokens": 4}
# field change -> words the error must contain (it names the problem)
INVALID: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"request_id": ""}, "request_id"),
    ({"input_token_ids": []}, "input_token_ids"),
    ({"input_token_ids": [-1]}, "input_token_ids"),
    ({"input_token_ids": [5, "x"]}, "input_token_ids"),
    ({"input_token_ids": b"\x01\x02\x03"}, "multiple of 4"),
    ({"prompt": "hello"}, "exactly one of prompt, messages and input_token_ids"),
    ({"input_token_ids": None}, "exactly one of prompt, messages and input_token_ids"),
    ({"input_token_ids": None, "prompt": ""}, "prompt"),
    ({"streaming": 1}, "streaming"),
    ({"sampling_config": {"temperature": -1.0}}, "temperature"),
    ({"sampling_config": {"top_p": 1.5}}, "top_p"),
    ({"sampling_config": {"top_k": -2}}, "top_k"),
    ({"sampling_config": {"beam_width": 0}}, "beam_width"),
    ({"sampling_config": {"seed": -5}}, "seed"),
    ({"sampling_config": {"no_such_knob": 1}}, "no_such_knob"),
    ({"priority": 2.0}, "priority"),
    ({"num_return_sequences": 0}, "num_return_sequences"),
    ({"stop": [""]}, "stop"),
    ({"stop_words": [[]]}, "stop_words"),
    ({"embedding_bias": [float("nan")]}, "embedding_bias"),
    ({"guided_decoding_params": {"guide_type": "regex"}}, "non-empty guide"),
    ({"surprise": True}, "surprise"),
]


@pytest.mark.parametrize(("change", "words"), INVALID, ids=[str(c) for c, _ in INVALID])
def test_each_invalid_field_is_named(service, wire, change, words):
    payload = {**VALID, **change}
    if payload.get("input_token_ids") is None:
        payload.pop("input_token_ids", None)
    if payload.get("max_tokens") is None:
        payload.pop("max_tokens")
    wire.send_raw(_packed([1, "submit", payload]))
    if payload.get("request_id"):
        wire.wait(["bad"], timeout=10)
        (reply,) = wire.errors["bad"]
    else:
        reply = wire.wait_error()
    assert reply.code == protocol.ErrorCode.PROTOCOL
    assert words in reply.message, reply.message


# Well-formed but not servable: answered by the gateway or the worker's executor.
UNSERVABLE: list[tuple[dict[str, Any], str]] = [
    ({"input_token_ids": [5, 100_000]}, "vocabulary"),
    ({"max_tokens": 10_000}, "context"),
    ({"model": "no-such-model"}, "no-such-model"),
    ({"logits_post_processor_name": "no_such_processor"}, "logits_post_processor_name"),
]


@pytest.mark.parametrize(("change", "words"), UNSERVABLE, ids=[str(c) for c, _ in UNSERVABLE])
def test_unservable_requests_get_an_error_for_that_request(service, wire, change, words):
    wire.send(protocol.Submit.model_validate({**VALID, **change}))
    wire.wait(["bad"], timeout=10)
    if wire.errors.get("bad"):
        message = wire.errors["bad"][0].message
    else:
        (response,) = wire.responses["bad"]
        assert response.error_msg is not None
        message = response.error_msg
    assert words in message, message
    _still_serving(service)


def test_duplicate_request_id_is_refused(service, wire):
    msg = protocol.Submit(request_id="dup", input_token_ids=[5, 6], max_tokens=300)
    wire.send(msg)
    wire.send(msg)
    wire.wait(["dup"], timeout=30)
    assert any("already in flight" in e.message for e in wire.errors["dup"])


def test_text_prompt_is_tokenized_by_the_gateway(service, wire):
    wire.send(protocol.Submit(request_id="text", prompt="The quick brown fox", max_tokens=5))
    wire.wait(["text"], timeout=30)
    (response,) = wire.responses["text"]
    assert response.result is not None
    assert len(response.result.output_token_ids[0]) == 5
    assert response.result.text is not None


def test_busy_beyond_the_per_client_limit(service):
    gw = service.gateway("--max-inflight-per-client", "2")
    gw.wait_workers(1)
    with Client([gw.endpoint], **CLIENT_OPTIONS) as client:
        long = {"max_tokens": 400, "min_tokens": 400}
        running = [client.submit([5, 6], **long) for _ in range(2)]
        refused = client.submit([5, 6], **long)
        with pytest.raises(RequestError, match="busy") as excinfo:
            refused.result(timeout=10)
        assert excinfo.value.code == "overloaded"
        for f in running:
            f.cancel()
            f.result(timeout=30)
        assert len(client.generate([5, 6], max_tokens=3, timeout=30).token_ids) == 3


@pytest.mark.parametrize(
    "change",
    [{"prompt": "x" * 5_000_000}, {"prompt": "hello", "stop": ["s"] * 5000}],
    ids=["5MB prompt", "5000 stop strings"],
)
def test_over_limit_messages_are_refused_by_request_id(service, wire, change):
    """A message refused before parsing (over a msgpack limit) is answered under its
    request id: answered without it, its client's call would hang."""
    wire.send_raw(_packed([1, "submit", {"request_id": "huge", "max_tokens": 4, **change}]))
    wire.wait(["huge"], timeout=10)
    (reply,) = wire.errors["huge"]
    assert reply.code == protocol.ErrorCode.PROTOCOL and "exceeds" in reply.message, reply
    _still_serving(service)


def test_the_client_checks_the_limits_before_sending(service):
    with Client([service.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        with pytest.raises(protocol.ProtocolError, match="exceeds"):
            client.generate("x" * 5_000_000, max_tokens=4, timeout=5)
        with pytest.raises(protocol.ProtocolError, match="exceeds"):
            client.generate("hello", max_tokens=4, stop=["s"] * 5000, timeout=5)


def test_huge_text_prompts_do_not_stall_other_clients(service, wire):
    """A 4 MB prompt is tokenized off the gateway's socket loop: on it, it would take
    seconds, workers would declare the gateway silent and every other client's stream
    would fail."""
    with Client([service.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        stream = client.stream([5, 6, 7], max_tokens=200, min_tokens=200, temperature=0.0)
        next(iter(stream))
        for i in range(3):
            wire.send(protocol.Submit(request_id=f"huge{i}", prompt="hello world " * 333_000, max_tokens=4))
        wire.wait([f"huge{i}" for i in range(3)], timeout=30)
        for i in range(3):
            (reply,) = wire.errors[f"huge{i}"]
            assert "context" in reply.message, reply
        assert len(stream.result(timeout=30).token_ids) == 200
    _still_serving(service)
