"""Requests that arrive before any worker can take them wait (bounded), then run."""

from __future__ import annotations

import pytest

from clients.client import Client, RequestError
from tests.procs import CLIENT_OPTIONS, Stack


def test_text_request_waits_for_the_first_worker(service_model, redis_url, tmp_path):
    s = Stack(service_model, redis_url, tmp_path)
    try:
        gw = s.gateway()
        gw.wait_log("listening")
        with Client([gw.endpoint], **CLIENT_OPTIONS) as client:
            future = client.submit("The quick brown fox", max_tokens=4)
            s.worker()
            result = future.result(timeout=30)
            assert len(result.token_ids) == 4
            assert result.text
    finally:
        s.close()


def test_no_worker_in_time_is_an_unavailable_error(service_model, redis_url, tmp_path):
    s = Stack(service_model, redis_url, tmp_path)
    try:
        gw = s.gateway("--no-worker-timeout", "0.5")
        gw.wait_log("listening")
        with Client([gw.endpoint], **CLIENT_OPTIONS) as client:
            with pytest.raises(RequestError, match="no worker") as excinfo:
                client.generate([5, 6], max_tokens=4, timeout=30)
            assert excinfo.value.code == "unavailable"
    finally:
        s.close()
