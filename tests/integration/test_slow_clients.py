"""A client that stops reading, over ZeroMQ or HTTP: the gateway's queue toward it is
bounded, it is cut off (its requests cancelled, logged) with an error it reads once it
reads again, and another client's stream beside it completes, every token in order."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest
import zmq

import protocol
from clients.client import Client
from tests.integration.test_metrics import scrape, value
from tests.integration.wire import WireClient
from tests.procs import CLIENT_OPTIONS, Stack, free_port

SEND_LIMIT = 20  # messages the gateway may queue for one client
# An echo worker makes these in seconds: far more than the queue and the kernel's buffers hold.
STREAMS, TOKENS = 48, 6000


@pytest.fixture
def echo_stack(long_model: Path, redis_url: str, tmp_path: Path):
    port, http_port = free_port(), free_port()
    s = Stack(long_model, redis_url, tmp_path)
    try:
        s.worker("--backend", "echo", "--max-batch-size", "64", "--kv-tokens", str(64 * 8192))
        s.gateway("--client-send-limit", str(SEND_LIMIT), "--metrics-port", str(port), "--http-port", str(http_port))
        s.gateways[0].wait_workers(1)
        yield s, port, http_port
    finally:
        s.close()


def test_a_client_that_stops_reading_is_cut_off_and_another_is_served(echo_stack) -> None:
    s, metrics_port, _ = echo_stack
    gateway = s.gateways[0]
    stalled = WireClient(gateway.endpoint)
    try:
        stalled.sock.setsockopt(zmq.RCVHWM, 1)
        stalled.sock.setsockopt(zmq.RCVBUF, 4096)
        stalled.hello()
        ids = [f"stalled-{i}" for i in range(STREAMS)]
        for i, request_id in enumerate(ids):
            stalled.send(protocol.Submit(request_id=request_id, input_token_ids=[5 + i, 6, 7], max_tokens=TOKENS,
                                         streaming=True, end_id=-1))  # fmt: skip
        # From here on the stalled client reads nothing (not even heartbeats) until it is cut off.
        with Client([gateway.endpoint], **CLIENT_OPTIONS) as client:
            result = client.generate([9, 8, 7], max_tokens=500, min_tokens=500, timeout=60)
        assert len(result.token_ids) == 500
        gateway.wait_log("cut off: this client left 20 of the gateway's messages unread", timeout=60)
        cancelled = value(scrape(metrics_port), "tokenwire_gateway_client_cancels_total", model="tiny-llama-long",
                          how="unread")  # fmt: skip
        assert cancelled == STREAMS

        # Reading again, it gets what was queued, then an error for each request naming why.
        deadline = time.monotonic() + 30
        while not all(stalled.errors.get(i) for i in ids) and time.monotonic() < deadline:
            stalled.pump(0.1)
        for request_id in ids:
            (error,) = stalled.errors[request_id]
            assert error.code == protocol.ErrorCode.OVERLOADED
            assert "left 20 of the gateway's messages unread" in error.message
            assert len([r for r in stalled.responses[request_id] if r.result is not None]) < TOKENS
    finally:
        stalled.close()


def _completion(prompt: list[int], max_tokens: int, **extra: object) -> bytes:
    return json.dumps({"model": "tiny-llama-long", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, **extra}).encode()


def test_an_http_client_that_stops_reading_is_cut_off_and_another_is_served(echo_stack) -> None:
    s, _, http_port = echo_stack
    stalled = socket.socket()
    try:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes stall
        stalled.connect(("127.0.0.1", http_port))
        # Eight sequences: more events than the kernel's and the server's buffers hold (one sequence's fit).
        body = _completion([5, 6, 7], TOKENS, n=8, temperature=1.0)
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        # From here on it reads nothing until it is cut off; another HTTP client streams beside it.
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", _completion([9, 8, 7], 500),
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as answer:
            events = [line for line in answer.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert sum(1 for e in events[:-1] if json.loads(e[6:])["choices"]) >= 1
        s.gateways[0].wait_log("cut off: this HTTP client left 20 of the stream's events unread", timeout=60)

        # Reading again, it gets what was written and queued, then the error, then the end.
        stalled.settimeout(30)
        data = b""
        while b"data: [DONE]" not in data:
            chunk = stalled.recv(1 << 16)
            assert chunk, "the connection closed before the stream's end"
            data += chunk
        assert b"cut off: this HTTP client left 20 of the stream's events unread" in data
        assert data.count(b'"text"') < 8 * TOKENS
    finally:
        stalled.close()
