"""Cancel by each path ends the stream with finish reason CANCELLED and frees the
worker's KV blocks (read from the worker's heartbeat and request stats in Redis)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clients.client import Client, FinishReason, RequestFuture
from tests.procs import CLIENT_OPTIONS, stack

# Seconds of work for the tiny model, so every cancel lands mid-stream.
LONG = {"max_tokens": 6000, "min_tokens": 6000, "temperature": 0.0}


@pytest.fixture(scope="module")
def service(long_model, redis_server, tmp_path_factory):
    url = redis_server.url
    with stack(long_model, url, tmp_path_factory.mktemp("cancel"), workers=1, gateways=1) as s:
        yield s


def _started(future: RequestFuture) -> None:
    chunks = iter(future)
    next(chunks)  # at least one token streamed: the request runs on the worker


def _assert_cancelled_and_freed(service, future: RequestFuture) -> None:
    result = future.result(timeout=30)
    assert result.finish_reason == FinishReason.CANCELLED
    assert 0 < len(result.token_ids) < LONG["max_tokens"]
    stats = service.request_stats(future.request_id)
    assert stats["finish_reason"] == "cancelled"
    service.wait_idle(service.workers[0])


def test_client_cancel(service):
    with Client([service.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        future = client.stream([5, 6, 7, 8], **LONG)
        _started(future)
        future.cancel()
        _assert_cancelled_and_freed(service, future)


def test_cli_cancel_through_redis_only(service):
    exe = shutil.which("tokenwire", path=str(Path(sys.executable).parent))
    command = [exe] if exe else [sys.executable, "-m", "clients.cli"]
    with Client([service.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        future = client.stream([9, 10, 11], **LONG)
        _started(future)
        done = subprocess.run(
            [*command, "cancel", future.request_id, "--redis", service.redis_url],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        _assert_cancelled_and_freed(service, future)


def test_client_disconnect_cancels(service):
    client = Client([service.gateways[0].endpoint], **CLIENT_OPTIONS)
    future = client.stream([12, 13, 14], **LONG)
    _started(future)
    client.close()  # the socket goes away without a word; the gateway notices the silence
    start = time.monotonic()
    stats = service.request_stats(future.request_id, timeout=10)
    assert stats["finish_reason"] == "cancelled"
    assert int(stats["output_tokens"]) < LONG["max_tokens"]  # stopped, not run to the end
    service.wait_idle(service.workers[0])
    assert time.monotonic() - start < 10
