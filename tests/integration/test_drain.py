"""SIGTERM drains a worker: during 50 streaming requests, each ends complete or with
the "worker draining" error, the worker exits 0 and leaves the registry, and the
gateway sends new requests only to the other worker."""

from __future__ import annotations

import signal
import time

import pytest

from clients.client import Client, FinishReason
from clients.connection import RequestError
from protocol import ErrorCode
from tests.procs import CLIENT_OPTIONS, MISSED, Stack

LONG = {"max_tokens": 6000, "min_tokens": 6000, "temperature": 0.0}  # cannot finish within the bound
SHORT = {"max_tokens": 40, "min_tokens": 40, "temperature": 0.0}  # finishes within it
MEDIUM = {"max_tokens": 400, "min_tokens": 400, "temperature": 0.0}  # 25 of them cannot finish within 1 s


def test_sigterm_during_50_streams(long_model, redis_url, tmp_path):
    s = Stack(long_model, redis_url, tmp_path)
    try:
        draining = s.worker("--drain-timeout", "1")
        s.gateway("--no-worker-timeout", "20")
        s.gateways[0].wait_workers(1)
        # While the second worker loads, a 2-core machine can leave the gateway silent for
        # longer than three of its short (test) heartbeat intervals, when a client with the
        # default missed_heartbeats gives it up (CI once saw 0.9 s): this one allows MISSED.
        with Client([s.gateways[0].endpoint], missed_heartbeats=MISSED) as client:
            futures = [client.stream([5 + i % 50, 6, 7], **(MEDIUM if i % 2 else SHORT)) for i in range(50)]
            for f in futures:
                next(iter(f))  # every one has streamed a token: all 50 run on the worker
            draining.process.send_signal(signal.SIGTERM)
            s.gateways[0].wait_log("worker worker0 draining", timeout=30)
            # Sent while the only worker drains: they wait for another, and never fail.
            late = [client.submit([9, 10, 11], max_tokens=4) for _ in range(5)]
            other = s.worker()
            assert draining.process.wait(timeout=30) == 0, draining.log()[-3000:]

            # The short ones finish on the draining worker; those still running at its bound go on
            # through the other one (gateway/migration.py): none fails.
            for i, f in enumerate(futures):
                result = f.result(timeout=120)
                assert result.finish_reason == FinishReason.LENGTH
                assert len(result.token_ids) == (MEDIUM if i % 2 else SHORT)["max_tokens"]
            log = s.gateways[0].log()
            assert log.count("continued on another worker") >= 1, "the bound cut no stream short"
            assert "worker draining: worker0 is shutting down (its 1 s bound passed)" in log

            assert s.redis.zscore(s.keys.workers(), draining.worker_id) is None
            assert not s.redis.exists(s.keys.worker(draining.worker_id), s.keys.heartbeat(draining.worker_id))

            for f in late:
                f.result(timeout=30)
                assert s.request_stats(f.request_id)["worker"] == other.worker_id
    finally:
        s.close()


def test_second_sigterm_ends_the_drain_at_once(long_model, redis_url, tmp_path):
    s = Stack(long_model, redis_url, tmp_path)
    try:
        worker = s.worker("--drain-timeout", "600")
        s.gateway("--no-worker-timeout", "2")
        s.gateways[0].wait_workers(1)
        with Client([s.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
            future = client.stream([5, 6, 7], **LONG)
            next(iter(future))
            worker.process.send_signal(signal.SIGTERM)
            worker.wait_log("draining: ", timeout=30)
            t0 = time.monotonic()
            worker.process.send_signal(signal.SIGTERM)
            assert worker.process.wait(timeout=30) == 0
            assert time.monotonic() - t0 < 10
            # Dropped by its only worker, it waits for another, then fails saying why.
            with pytest.raises(RequestError, match=r"dropped it after \d+ tokens: worker draining: .*SIGTERM") as e:
                future.result(timeout=30)
            assert e.value.code == ErrorCode.UNAVAILABLE
    finally:
        s.close()


@pytest.mark.slow
def test_drains_finish_started_streams_and_keep_their_stats(long_model, redis_url, tmp_path):
    """A draining worker writes every finished request's stats to Redis (its Redis
    thread flushes before it stops), and a gateway at SIGTERM finishes its started
    streams before it exits."""
    medium = {"max_tokens": 150, "min_tokens": 150, "temperature": 0.0}
    s = Stack(long_model, redis_url, tmp_path)
    try:
        worker = s.worker("--drain-timeout", "20")
        gateway = s.gateway("--drain-timeout", "20")
        gateway.wait_workers(1)
        with Client([gateway.endpoint], **CLIENT_OPTIONS) as client:
            futures = [client.stream([5 + i, 6, 7], **medium) for i in range(6)]
            for f in futures:
                next(iter(f))
            worker.process.send_signal(signal.SIGTERM)
            assert worker.process.wait(timeout=30) == 0, worker.log()[-3000:]
            for f in futures:
                assert len(f.result(timeout=10).token_ids) == 150
            for f in futures:  # every one of them, at once: written before the worker exited
                assert s.request_stats(f.request_id, timeout=0.1)["output_tokens"] == "150"

            s.worker()
            gateway.wait_workers(2)
            futures = [client.stream([5 + i, 6, 7], **medium) for i in range(6)]
            for f in futures:
                next(iter(f))
            gateway.process.send_signal(signal.SIGTERM)
            gateway.wait_log("draining: 6 requests in flight")
            for f in futures:
                assert len(f.result(timeout=20).token_ids) == 150
            assert gateway.process.wait(timeout=10) == 0, gateway.log()[-3000:]
            assert "drained: every request finished" in gateway.log()
    finally:
        s.close()
