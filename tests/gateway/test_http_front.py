"""The HTTP front through the official `openai` SDK and `curl -N`, against a real
gateway and worker (processes, Redis, the tiny checkpoint): one stack for the module."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import jsonschema
import pytest

from tests.integration.test_metrics import scrape
from tests.procs import Gateway, free_port, stack

openai = pytest.importorskip("openai")

MODEL = "tiny-llama-long"
# The tiny model never ends early with these: requests of a known length.
FIXED = {"temperature": 0.0, "extra_body": {"min_tokens": 24}}


@pytest.fixture(scope="module")
def service(long_model, redis_server, tmp_path_factory):
    port = free_port()
    with stack(long_model, redis_server.url, tmp_path_factory.mktemp("http"), workers=0, gateways=0) as s:
        s.worker()
        # At most 2 requests in flight: the third is refused (back-pressure, 429).
        s.gateway("--http-port", str(port), "--max-inflight", "2")
        s.gateways[0].wait_workers(1)
        s.http_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
        yield s


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=f"{service.http_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_completion_whole_and_streamed_agree(client):
    whole = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, **FIXED)
    (choice,) = whole.choices
    assert choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    assert whole.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, stream=True,
                                            **FIXED))  # fmt: skip
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_whole_and_streamed_agree(client):
    messages = [{"role": "user", "content": "Paris is the capital of"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, **FIXED)
    (choice,) = whole.choices
    assert choice.message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}, **FIXED)  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def _sse_data(url: str, body: dict[str, object]) -> list[bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        raw = r.read()
    events = raw.split(b"\n\n")
    assert events.pop() == b"" and events.pop() == b"data: [DONE]", raw[-200:]
    assert all(e.startswith(b"data: {") for e in events)
    return [e.removeprefix(b"data: ") for e in events]


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_chunks_are_compact_ascii_json_in_openais_key_order(service, chat):
    """Every chunk to the byte as json.dumps(separators=(",", ":")) writes OpenAI's chunk object:
    the plain steps' chunks are rendered from a template, and must not differ from the rest.
    The tiny model's text is full of escapes (control characters, U+FFFD) to get right."""
    ask = {"messages": [{"role": "user", "content": 'héllo "wörld"'}]} if chat else {"prompt": 'héllo "wörld"'}
    body = {"model": MODEL, **ask, "max_tokens": 32, "min_tokens": 32, "temperature": 0.0, "stream": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    chunks = _sse_data(service.http_url + path, body)
    steps = 0
    for raw in chunks:
        chunk = json.loads(raw)
        assert json.dumps(chunk, separators=(",", ":")).encode() == raw
        assert list(chunk) == ["id", "object", "created", "model", "choices"]
        (choice,) = chunk["choices"]
        delta = "delta" if chat else "text"
        assert list(choice) == ["index", delta, "logprobs", "finish_reason"]
        steps += choice["finish_reason"] is None and bool(choice[delta])
    assert steps >= 8, chunks  # the plain steps' chunks were among them
    assert {json.loads(c)["id"] for c in chunks} == {json.loads(chunks[0])["id"]}


def test_n_and_seed(client):
    def sample(seed: int) -> list[str]:
        r = client.completions.create(model=MODEL, prompt="héllo", max_tokens=12, n=2, temperature=1.0, seed=seed,
                                      extra_body={"min_tokens": 12})  # fmt: skip
        assert [c.index for c in r.choices] == [0, 1]
        assert r.usage.completion_tokens == 24
        return [c.text for c in r.choices]

    first = sample(7)
    assert sample(7) == first, "the same seed gives the same text"
    assert sample(8) != first


def test_several_prompts_are_a_request_each_answered_in_order(client):
    prompts = ["The quick brown fox", "héllo"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, **FIXED) for p in prompts]
    both = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, n=2, **FIXED)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]  # choice k * n + i: prompt k's i-th
    assert [c.text for c in both.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert both.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert both.usage.completion_tokens == 4 * 8


def test_logit_bias_reaches_the_sampler(client, long_model):
    # The dense bias it becomes is checked in test_openai_api; here, that it acts.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(long_model / "tokenizer.json"))
    for token in (42, 77):
        forced = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, logit_bias={str(token): 100},
                                           **FIXED)  # fmt: skip
        assert forced.choices[0].text == tokenizer.decode([token] * 4)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"100000": 5})


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt="tokenwire streams", max_tokens=24, **FIXED)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"pick another prompt: {text!r}"
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="tokenwire streams", max_tokens=24, stop=[stop],
                                      stream=stream, **FIXED)  # fmt: skip
        chunks = list(r) if stream else [r]
        got = "".join(c.choices[0].text for c in chunks)
        assert got == text[: text.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          logprobs=True, top_logprobs=3, **FIXED)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)  # greedy: the likeliest
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="hi", max_tokens=5, logprobs=2, **FIXED)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_response_format_json_schema(client):
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}  # fmt: skip
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "yes or no?"}],
        max_tokens=64,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, schema)  # raises ValidationError on output the schema refuses
    assert answer["answer"] in ("yes", "no")


def test_errors_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as e404:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e404.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e400:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=7.0)
    assert e400.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="top_kk"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"top_kk": 3})
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)


def test_back_pressure_and_disconnect_cancels(service, client):
    long = {"max_tokens": 6000, "temperature": 0.0, "extra_body": {"min_tokens": 6000}}
    streams = [client.completions.create(model=MODEL, prompt=f"long {i}", stream=True, **long) for i in range(2)]
    firsts = [next(iter(s)) for s in streams]  # both run at the worker
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="one too many", max_tokens=2)
    for s in streams:
        s.close()  # the client goes away mid-stream
    for first in firsts:
        stats = service.request_stats(first.id, timeout=10)
        deadline = time.monotonic() + 10
        while stats.get("finish_reason") != "cancelled" and time.monotonic() < deadline:
            time.sleep(0.1)
            stats = service.request_stats(first.id)
        assert stats["finish_reason"] == "cancelled"
    service.wait_idle(service.workers[0])


def test_a_client_gone_from_a_whole_response_cancels_its_request(service):
    worker = service.workers[0]
    service.wait_idle(worker)
    pattern = service.keys.request_stats("cmpl-*")
    before = set(service.redis.scan_iter(pattern))
    port = int(service.http_url.rsplit(":", 1)[1])
    cancels = ("tokenwire_gateway_client_cancels_total", frozenset({("model", MODEL), ("how", "cancel")}))
    cancels_before = scrape(port).get(cancels, 0.0)
    body = json.dumps({"model": MODEL, "prompt": "long whole", "max_tokens": 6000, "temperature": 0.0,
                       "min_tokens": 6000}).encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        deadline = time.monotonic() + 10
        while service.load(worker).num_active_requests == 0:  # it runs at the worker
            assert time.monotonic() < deadline, "the request never reached the worker"
            time.sleep(0.05)
    # The connection closed with no response read: the worker's request ends long before its 6,000 tokens.
    service.wait_idle(worker, timeout=10)
    (key,) = set(service.redis.scan_iter(pattern)) - before
    stats = service.request_stats(key.decode().rsplit(":", 1)[1])
    assert stats["finish_reason"] == "cancelled" and int(stats["output_tokens"]) < 6000
    assert scrape(port)[cancels] == cancels_before + 1  # counted as a client's cancel, by model


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_models_health_metrics(service, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert _get(f"{service.http_url}/health") == (200, b'{"status":"ok"}')
    status, metrics = _get(f"{service.http_url}/metrics")
    assert status == 200
    assert b"tokenwire_gateway_requests_total" in metrics


def test_health_is_503_with_the_reason_without_workers_or_redis(service, tmp_path):
    """200 only when Redis answers and a worker is ready (checked above); else 503 and why."""
    ports = [free_port(), free_port()]
    gateways = [  # the stack's Redis with a prefix no worker uses; a Redis that is not there
        Gateway("lonely", service.redis_url, tmp_path, "--http-port", str(ports[0]), "--redis-prefix", "nobody"),
        Gateway("cut-off", f"redis://127.0.0.1:{free_port()}/0", tmp_path, "--http-port", str(ports[1])),
    ]
    try:
        for gateway, port, reason in zip(gateways, ports, ("no worker is ready", "Redis does not answer"),
                                         strict=True):  # fmt: skip
            deadline = time.monotonic() + 30
            while True:
                try:
                    status, body = _get(f"http://127.0.0.1:{port}/health")
                except OSError:  # not listening yet
                    status, body = 0, b"null"
                # Until its discovery thread's first read, a gateway has not heard from Redis either.
                if (status, json.loads(body)) == (503, {"status": "unavailable", "reason": reason}):
                    break
                assert time.monotonic() < deadline and gateway.alive, (status, body, gateway.log())
                time.sleep(0.1)
    finally:
        for gateway in gateways:
            gateway.stop()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_server_sent_events(service):
    script = Path(__file__).with_name("http_stream.sh")
    run = subprocess.run(["bash", str(script), service.http_url, MODEL], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
