"""API keys, against a real gateway and worker: keys from a file, the environment
and Redis (`tokenwire keys`), checked on every /v1 route through the `openai`
SDK and in the ZeroMQ client's Hello; a key revoked in Redis stops working."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

from clients.client import Client
from clients.connection import RequestError
from tests.gateway.keys_cli import tokenwire
from tests.procs import CLIENT_OPTIONS, free_port, stack

openai = pytest.importorskip("openai")

FILE_KEY = "tw-file-key-for-tests"
ENV_KEY = "tw-env-key-for-tests"


@pytest.fixture(scope="module")
def service(service_model, redis_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api_keys")
    key_file = tmp / "keys"
    key_file.write_text(f"# name key\nfile-user {FILE_KEY}\n")
    port = free_port()
    os.environ["TOKENWIRE_API_KEYS"] = ENV_KEY  # the gateway's environment
    try:
        with stack(service_model, redis_server.url, tmp, workers=1, gateways=0) as s:
            s.gateway("--http-port", str(port), "--api-keys-file", str(key_file), "--api-keys-redis")
            s.gateways[0].wait_workers(1)
            s.http_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
            yield s
    finally:
        del os.environ["TOKENWIRE_API_KEYS"]


def _openai(service, key: str):
    """An SDK client sending `key`; "" sends no key at all (the SDK itself insists on one)."""
    headers = {} if key else {"Authorization": ""}
    return openai.OpenAI(base_url=f"{service.http_url}/v1", api_key=key or "unused", max_retries=0, timeout=30,
                         default_headers=headers)


def _complete(service, key: str) -> int:
    with _openai(service, key) as c:
        return c.completions.create(model="tiny-llama", prompt="hello", max_tokens=3).usage.completion_tokens


def test_no_key_or_a_wrong_key_gets_openais_401(service) -> None:
    for key in ("", "tw-wrong"):
        with _openai(service, key) as c:
            for call in (lambda: c.models.list(),
                         lambda: c.completions.create(model="tiny-llama", prompt="x", max_tokens=2),
                         lambda: c.chat.completions.create(model="tiny-llama", max_tokens=2,
                                                           messages=[{"role": "user", "content": "x"}])):  # fmt: skip
                with pytest.raises(openai.AuthenticationError) as excinfo:
                    call()
                assert excinfo.value.status_code == 401
                assert excinfo.value.body["code"] == "invalid_api_key"
    req = urllib.request.Request(f"{service.http_url}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(req, timeout=10)
    body = json.loads(http_error.value.read())
    assert body["error"]["type"] == "invalid_request_error" and "API key" in body["error"]["message"]
    with urllib.request.urlopen(f"{service.http_url}/health", timeout=10) as r:  # open by default
        assert json.loads(r.read())["status"] == "ok"


def test_keys_from_the_file_and_the_environment_are_served(service) -> None:
    assert _complete(service, FILE_KEY) == 3
    assert _complete(service, ENV_KEY) == 3


def test_a_key_added_in_redis_works_on_the_gateway_and_stops_when_revoked(service) -> None:
    added = tokenwire(service.redis_url, "add", "alice")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    stored = service.redis.hgetall(service.keys.api_keys())
    assert key.encode() not in b"".join([*stored, *stored.values()])  # only its hash is stored
    listed = [json.loads(line) for line in tokenwire(service.redis_url, "list").stdout.splitlines()]
    assert "alice" in [x["name"] for x in listed]

    deadline = time.monotonic() + 10
    while True:  # accepted once the gateway's refresh has read it
        try:
            assert _complete(service, key) == 3
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline, "a key added in Redis was not accepted within 10 s"
            time.sleep(0.2)

    assert tokenwire(service.redis_url, "revoke", "alice").returncode == 0
    revoked_at = time.monotonic()
    while True:
        try:
            _complete(service, key)
        except openai.AuthenticationError:  # a 401
            break
        assert time.monotonic() - revoked_at < 10, "a revoked key still works after 10 s"
        time.sleep(0.2)
    assert tokenwire(service.redis_url, "revoke", "alice").returncode == 1  # named, and gone


def test_the_zeromq_client_gives_its_key_in_hello(service) -> None:
    endpoint = service.gateways[0].endpoint
    with Client([endpoint], **CLIENT_OPTIONS, api_key=FILE_KEY) as client:
        assert len(client.generate([5, 6, 7], max_tokens=4, timeout=30).token_ids) == 4
    for key in (None, "tw-wrong"):
        with Client([endpoint], **CLIENT_OPTIONS, api_key=key, connect_timeout_s=1.0, connect_attempts=1) as client:
            with pytest.raises(RequestError, match="needs an API key") as excinfo:
                client.generate([5, 6, 7], max_tokens=4, timeout=10)
            assert excinfo.value.code == "unauthorized"
    service.gateways[0].wait_log("got an API key that is not accepted")


def test_gateway_keeps_serving(service) -> None:
    assert service.gateways[0].alive and service.workers[0].alive
