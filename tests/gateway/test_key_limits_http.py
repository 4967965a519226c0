"""Per-key limits over two gateways on one Redis, through the `openai` SDK: a key
over its concurrency, requests or tokens per minute gets OpenAI's 429 with
`retry-after` and `x-ratelimit-*` while another key is served, on the gateway
that counted and, one sync later, on the other; usage in Redis (`tokenwire keys
usage`) and on /metrics equals the tokens served; a request is admitted and
counted without waiting on Redis."""

from __future__ import annotations

import json
import time

import pytest
import redis

from clients.client import Client
from gateway.key_limits import SYNC_S, SYNC_TIMEOUT_S
from tests.gateway.keys_cli import tokenwire
from tests.integration.test_metrics import scrape, value
from tests.procs import CLIENT_OPTIONS, free_port, stack

openai = pytest.importorskip("openai")

MODEL = "tiny-llama-long"
FIXED = {"temperature": 0.0, "extra_body": {"min_tokens": 8}}
# A gateway sees another's count once that one's next sync has written it and its own
# next sync has read it: two sync intervals, and time for the syncs themselves.
SEEN_S = 2 * SYNC_S + 0.5


@pytest.fixture(scope="module")
def service(long_model, redis_server, tmp_path_factory):
    ports = [free_port(), free_port()]
    with stack(long_model, redis_server.url, tmp_path_factory.mktemp("limits"), workers=1, gateways=0) as s:
        for port in ports:
            s.gateway("--http-port", str(port), "--api-keys-redis")
        for g in s.gateways:
            g.wait_workers(1)
        s.urls = [f"http://127.0.0.1:{p}" for p in ports]  # type: ignore[attr-defined]
        yield s


def _key(service, name: str, *limits: str) -> str:
    added = tokenwire(service.redis_url, "add", name, *limits)
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    for url in service.urls:  # accepted by both gateways once their refresh has read it
        deadline = time.monotonic() + 10
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as c:
            while True:
                try:
                    c.models.list()
                    break
                except openai.AuthenticationError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
    return key


def _sdk(url: str, key: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def _complete(url: str, key: str, max_tokens: int = 8):
    with _sdk(url, key) as c:
        return c.completions.create(model=MODEL, prompt="hello there", max_tokens=max_tokens, **FIXED)


def _away_from_a_minute_boundary() -> None:
    """The per-minute windows turn over on the minute: start a test well inside one."""
    if time.time() % 60 > 40:
        time.sleep(61 - time.time() % 60)


def test_requests_per_minute_hold_across_gateways(service) -> None:
    _away_from_a_minute_boundary()
    tight = _key(service, "rpm3", "--requests-per-minute", "6")  # _key's checks spend 2 of them
    other = _key(service, "free")
    a, b = service.urls
    for url in (a, b, a, b):
        assert _complete(url, tight).usage.completion_tokens == 8
    time.sleep(SEEN_S)
    with pytest.raises(openai.RateLimitError) as excinfo:
        _complete(b, tight)
    response = excinfo.value.response
    assert response.status_code == 429
    assert excinfo.value.body["code"] == "rate_limit_exceeded"
    assert response.headers["x-ratelimit-limit-requests"] == "6"
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(response.headers["retry-after"]) <= 60
    with pytest.raises(openai.RateLimitError):  # the other gateway, too
        _complete(a, tight)
    assert _complete(a, other).usage.completion_tokens == 8  # another key is served meanwhile


def test_concurrency_holds_across_gateways(service) -> None:
    one = _key(service, "one-at-a-time", "--max-concurrent", "1")
    a, b = service.urls
    with _sdk(a, one) as c:
        stream = c.completions.create(model=MODEL, prompt="hi", max_tokens=4000, stream=True, temperature=0.0,
                                      extra_body={"min_tokens": 4000})  # fmt: skip
        chunks = iter(stream)
        next(chunks)
        with pytest.raises(openai.RateLimitError):  # on its own gateway at once
            _complete(a, one)
        time.sleep(SEEN_S)
        with pytest.raises(openai.RateLimitError) as excinfo:
            _complete(b, one)
        assert excinfo.value.response.headers["retry-after"] == "1"
        assert "concurrent" in excinfo.value.message
        assert _complete(b, _key(service, "bystander")).usage.completion_tokens == 8
        assert next(chunks).choices[0].finish_reason is None  # still in flight all along
        stream.close()  # the gateway cancels it
    deadline = time.monotonic() + 10
    while True:  # its slot is free again, on the other gateway too, once its end is seen
        try:
            assert _complete(b, one).usage.completion_tokens == 8
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(SEEN_S)


def test_one_count_serves_both_fronts_of_a_gateway(service) -> None:
    one = _key(service, "both-fronts", "--max-concurrent", "1")
    a, _ = service.urls
    with Client([service.gateways[0].endpoint], **CLIENT_OPTIONS, api_key=one) as client:
        long = client.stream([5, 6, 7, 8], max_tokens=1000, min_tokens=1000)
        chunks = long.chunks(timeout=60)
        next(chunks)
        # Admitted on the socket loop, refused on the HTTP front's loop: no sync between them.
        with pytest.raises(openai.RateLimitError) as excinfo:
            _complete(a, one)
        assert "concurrent requests: limit 1, used 1" in excinfo.value.message
        assert not long.done()
        long.cancel()
        long.result(timeout=30)


def test_tokens_per_minute_hold(service) -> None:
    _away_from_a_minute_boundary()
    small = _key(service, "tpm", "--tokens-per-minute", "20")
    a, b = service.urls
    served = _complete(a, small, max_tokens=16)
    assert served.usage.total_tokens >= 20
    time.sleep(SEEN_S)
    with pytest.raises(openai.RateLimitError) as excinfo:
        _complete(b, small)
    headers = excinfo.value.response.headers
    assert headers["x-ratelimit-limit-tokens"] == "20" and headers["x-ratelimit-remaining-tokens"] == "0"


def test_usage_counts_equal_the_tokens_served(service) -> None:
    key = _key(service, "counted")
    a, b = service.urls
    before = [scrape_tokens(url) for url in service.urls]
    served = [_complete(url, key, max_tokens=5 + i) for i, url in enumerate((a, b, a))]
    with _sdk(b, key) as c:
        streamed = list(c.completions.create(model=MODEL, prompt="hello there", max_tokens=7, stream=True,
                                             stream_options={"include_usage": True}, **FIXED))  # fmt: skip
    usages = [r.usage for r in served] + [streamed[-1].usage]
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    assert completion == 5 + 6 + 7 + 7
    deadline = time.monotonic() + 10
    while True:  # counted after each response went out
        (row,) = [json.loads(line) for line in tokenwire(service.redis_url, "usage", "counted").stdout.splitlines()]
        if row["requests"] >= 4 + 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # _key's two /v1/models checks count as requests, with no tokens
    assert row == {"name": "counted", "requests": 6, "prompt_tokens": prompt, "completion_tokens": completion}
    after = [scrape_tokens(url) for url in service.urls]
    assert sum(x[1] - y[1] for x, y in zip(after, before, strict=True)) == completion
    assert sum(x[0] - y[0] for x, y in zip(after, before, strict=True)) == prompt


def test_a_request_is_served_and_counted_while_redis_does_not_answer(service) -> None:
    key = _key(service, "unhurried", "--max-concurrent", "4", "--requests-per-minute", "1000")
    a, _ = service.urls
    pause_s = 3.0  # under the sync's timeout: its write waits for Redis and is sent once
    assert pause_s < SYNC_TIMEOUT_S
    with redis.Redis.from_url(service.redis_url) as r:
        paused_at = time.monotonic()
        r.execute_command("CLIENT", "PAUSE", int(pause_s * 1000), "ALL")
        served = [_complete(a, key, max_tokens=8 + i) for i in range(2)]
        # Redis answers no one before paused_at + pause_s: these never waited on it.
        assert time.monotonic() < paused_at + pause_s
        assert r.ping()  # answers once the pause is over
    deadline = time.monotonic() + 10
    while True:  # the sync that waited on the pause writes the counts once
        (row,) = [json.loads(line) for line in tokenwire(service.redis_url, "usage", "unhurried").stdout.splitlines()]
        if row["requests"] >= 2 + 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(SEEN_S)  # and nothing is counted again at the syncs after it
    (row,) = [json.loads(line) for line in tokenwire(service.redis_url, "usage", "unhurried").stdout.splitlines()]
    assert row == {"name": "unhurried", "requests": 4, "prompt_tokens": sum(s.usage.prompt_tokens for s in served),
                   "completion_tokens": 8 + 9}  # fmt: skip


def scrape_tokens(url: str) -> tuple[float, float]:
    samples = scrape(int(url.rsplit(":", 1)[1]))

    def get(direction: str) -> float:
        try:
            return value(samples, "tokenwire_gateway_api_key_tokens_total", key="counted", direction=direction)
        except AssertionError:
            return 0.0

    return get("in"), get("out")


def test_limits_leave_the_gateways_serving(service) -> None:
    assert all(p.alive for p in [*service.gateways, *service.workers])
