"""A client that stops reading: the gateway's queue toward it is bounded, it is cut off
(its requests cancelled, counted, logged) with an error it reads once it reads again,
and another client's stream beside it completes, every token in order."""

from __future__ import annotations

import time
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
    port = free_port()
    s = Stack(long_model, redis_url, tmp_path)
    try:
        s.worker("--backend", "echo", "--max-batch-size", "64", "--kv-tokens", str(64 * 8192))
        s.gateway("--client-send-limit", str(SEND_LIMIT), "--metrics-port", str(port))
        s.gateways[0].wait_workers(1)
        yield s, port
    finally:
        s.close()


def test_a_client_that_stops_reading_is_cut_off_and_another_is_served(echo_stack) -> None:
    s, metrics_port = echo_stack
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
