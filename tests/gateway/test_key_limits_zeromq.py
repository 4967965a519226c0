"""Per-key limits and usage for ZeroMQ clients, over two gateways on one Redis:
a key over its concurrency gets RATE_LIMITED (with its retry-after) for that
request alone while another key is served; usage in Redis (`tokenwire keys
usage`) and on /metrics equals the tokens served."""

from __future__ import annotations

import json
import time

import pytest

from clients.client import Client
from clients.connection import RequestError
from gateway.key_limits import SYNC_S
from tests.gateway.keys_cli import tokenwire
from tests.integration.test_metrics import scrape, value
from tests.procs import CLIENT_OPTIONS, free_port, stack

PROMPT = [5, 6, 7, 8]
# A gateway sees another's count once that one's next sync has written it and its own
# next sync has read it: two sync intervals, and time for the syncs themselves.
SEEN_S = 2 * SYNC_S + 0.5


@pytest.fixture(scope="module")
def service(long_model, redis_server, tmp_path_factory):
    ports = [free_port(), free_port()]
    with stack(long_model, redis_server.url, tmp_path_factory.mktemp("key_limits_zeromq"), workers=1, gateways=0) as s:
        for port in ports:
            s.gateway("--api-keys-redis", "--metrics-port", str(port))
        for g in s.gateways:
            g.wait_workers(1)
        s.metrics_ports = ports  # type: ignore[attr-defined]
        yield s


def _client(service, gateway: int, key: str) -> Client:
    return Client([service.gateways[gateway].endpoint], **CLIENT_OPTIONS, api_key=key)


def _key(service, name: str, *limits: str) -> str:
    added = tokenwire(service.redis_url, "add", name, *limits)
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    for gateway in (0, 1):  # accepted by both gateways once their refresh has read it
        deadline = time.monotonic() + 10
        while True:
            try:
                with _client(service, gateway, key) as c:
                    c.generate(PROMPT, max_tokens=1, timeout=30)
                break
            except RequestError as e:
                if e.code != "unauthorized" or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    return key


def _served(client: Client, max_tokens: int) -> int:
    return len(client.generate(PROMPT, max_tokens=max_tokens, min_tokens=max_tokens, timeout=60).token_ids)


def test_concurrency_holds_for_zeromq_clients_across_gateways(service) -> None:
    one = _key(service, "zmq-one", "--max-concurrent", "1")
    other = _key(service, "zmq-other")
    with _client(service, 0, one) as a, _client(service, 1, one) as b, _client(service, 1, other) as c:
        long = a.stream(PROMPT, max_tokens=4000, min_tokens=4000)
        chunks = long.chunks(timeout=60)
        next(chunks)
        time.sleep(SEEN_S)  # the other gateway has read the lease
        for client in (a, b):  # the same gateway and the other one
            with pytest.raises(RequestError, match="concurrent requests: limit 1") as excinfo:
                client.generate(PROMPT, max_tokens=4, timeout=30)
            assert excinfo.value.code == "rate_limited"
            assert "retry after 1 s" in str(excinfo.value)
        assert _served(c, 4) == 4
        assert not long.done()
        long.cancel()
        long.result(timeout=30)
        time.sleep(SEEN_S)  # its lease's end read by the other gateway
        assert _served(b, 4) == 4


def test_requests_per_minute_hold_for_zeromq_clients_across_gateways(service) -> None:
    if time.time() % 60 > 40:  # the per-minute windows turn over on the minute: start well inside one
        time.sleep(61 - time.time() % 60)
    tight = _key(service, "zmq-rpm", "--requests-per-minute", "4")  # _key's checks spend 2 of them
    for gateway in (0, 1):
        with _client(service, gateway, tight) as c:
            assert _served(c, 2) == 2
    time.sleep(SEEN_S)  # each gateway has read the other's count
    for gateway in (0, 1):
        with _client(service, gateway, tight) as c, pytest.raises(RequestError, match="requests per minute") as e:
            c.generate(PROMPT, max_tokens=2, timeout=30)
        assert e.value.code == "rate_limited"
        assert "retry after" in str(e.value)


def test_zeromq_usage_counts_equal_the_tokens_served(service) -> None:
    key = _key(service, "zmq-counted")  # _key's two requests: one token each
    before = [_scrape(port) for port in service.metrics_ports]
    served = 2
    for gateway, n in ((0, 5), (1, 6), (0, 7)):
        with _client(service, gateway, key) as c:
            served += _served(c, n)
    assert served == 2 + 5 + 6 + 7
    deadline = time.monotonic() + 10
    while True:  # written to Redis at each gateway's next sync
        (row,) = [json.loads(line) for line in tokenwire(service.redis_url, "usage", "zmq-counted").stdout.splitlines()]
        if row["requests"] >= 5 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert row == {"name": "zmq-counted", "requests": 5, "prompt_tokens": 5 * len(PROMPT), "completion_tokens": served}
    after = [_scrape(port) for port in service.metrics_ports]
    assert sum(x[1] - y[1] for x, y in zip(after, before, strict=True)) == served - 2
    assert sum(x[0] - y[0] for x, y in zip(after, before, strict=True)) == 3 * len(PROMPT)


def _scrape(port: int) -> tuple[float, float]:
    samples = scrape(port)

    def get(direction: str) -> float:
        try:
            return value(samples, "tokenwire_gateway_api_key_tokens_total", key="zmq-counted", direction=direction)
        except AssertionError:
            return 0.0

    return get("in"), get("out")


def test_limits_leave_the_gateways_serving(service) -> None:
    assert all(p.alive for p in [*service.gateways, *service.workers])
