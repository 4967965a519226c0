"""kill -9 of a worker, kill -9 of a gateway, Redis down for 10 s: what the
clients and the surviving processes see (DESIGN.md §5, promises 2-4)."""

from __future__ import annotations

import threading
import time

import pytest

from clients.client import Client, FinishReason, GatewayLostError, RequestError
from tests.procs import CLIENT_OPTIONS, HEARTBEAT_S, MISSED, stack

# A worker's streams must end within this bound after kill -9: the gateway
# declares it lost after MISSED silent heartbeat intervals, checked once per
# interval, plus a margin for a loaded 2-core machine.
WORKER_LOSS_BOUND_S = (MISSED + 2) * HEARTBEAT_S + 1.0


def test_kill_worker_mid_stream(long_model, redis_url, tmp_path):
    # Two running slots per worker, so each worker also holds a queued request.
    with stack(long_model, redis_url, tmp_path, workers=0, gateways=0) as s:
        for _ in range(2):
            s.worker("--max-batch-size", "2")
        s.gateway().wait_workers(2)
        with Client([s.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
            futures = [
                client.stream([20 + i, 21, 22], max_tokens=1500, min_tokens=1500, temperature=0.0)
                for i in range(6)
            ]
            firsts: dict[str, float] = {}
            ended: dict[str, float] = {}
            lock = threading.Lock()

            def follow(f):
                try:
                    for _ in f:
                        with lock:
                            firsts.setdefault(f.request_id, time.monotonic())
                except RequestError:
                    pass
                with lock:
                    ended[f.request_id] = time.monotonic()

            threads = [threading.Thread(target=follow, args=(f,)) for f in futures]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 20
            while len(firsts) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(firsts) == 4, "two requests running on each worker"
            victim = s.workers[0]
            victim.kill9()
            killed_at = time.monotonic()
            with lock:
                started_before_kill = set(firsts)
            for t in threads:
                t.join(timeout=60)

        lost, completed = [], []
        for f in futures:
            try:
                result = f.result(timeout=0)
                assert result.finish_reason == FinishReason.LENGTH
                assert len(result.token_ids) == 1500
                completed.append(f.request_id)
            except GatewayLostError:
                raise
            except RequestError as e:
                error = e
                lost.append(f.request_id)
                assert error.code == "unavailable"
                assert victim.worker_id in error.message
                assert f.request_id in started_before_kill, "only requests that had streamed may fail"
                assert ended[f.request_id] - killed_at < WORKER_LOSS_BOUND_S
        assert len(lost) == 2, "the two streams running on the killed worker end with an error"
        assert len(completed) == 4, "the others, including the killed worker's queued one, complete"
        s.wait_idle(s.workers[1])
        assert "re-dispatched" in s.gateways[0].log()


def test_kill_gateway(long_model, redis_url, tmp_path):
    with stack(long_model, redis_url, tmp_path, workers=1, gateways=2) as s:
        first, second = s.gateways
        with Client(
            [first.endpoint, second.endpoint], heartbeat_interval_s=HEARTBEAT_S, missed_heartbeats=MISSED
        ) as client:
            future = client.stream([30, 31, 32], max_tokens=6000, min_tokens=6000, temperature=0.0)
            next(iter(future))
            assert client.gateway == first.endpoint
            first.kill9()
            # The worker drops the orphan: cancelled, and its blocks back in the pool.
            stats = s.request_stats(future.request_id, timeout=15)
            assert stats["gateway"] == first.gateway_id
            assert stats["finish_reason"] == "cancelled"
            assert int(stats["output_tokens"]) < 6000
            s.wait_idle(s.workers[0])
            # The client: the started stream fails clearly; the next request goes to the other gateway.
            with pytest.raises(GatewayLostError, match=first.endpoint):
                future.result(timeout=15)
            result = client.generate([33, 34], max_tokens=5, timeout=30)
            assert len(result.token_ids) == 5
            assert client.gateway == second.endpoint


def test_redis_down_for_10_s(service_model, redis_server_factory, tmp_path):
    server = redis_server_factory()
    with stack(service_model, server.url, tmp_path, workers=1, gateways=1) as s:
        stream_key = s.keys.iteration_stats(s.workers[0].worker_id)
        failures: list[BaseException] = []
        done: list[str] = []
        stop = threading.Event()

        def load(client: Client) -> None:
            while not stop.is_set():
                futures = [client.stream([40 + i, 41], max_tokens=32, temperature=0.0) for i in range(8)]
                for f in futures:
                    try:
                        chunks = list(f)
                        assert sum(len(c.token_ids) for c in chunks) == 32
                        done.append(f.request_id)
                    except BaseException as e:
                        failures.append(e)

        with Client([s.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
            thread = threading.Thread(target=load, args=(client,))
            thread.start()
            time.sleep(1.0)
            server.stop()
            down_from = len(done)
            time.sleep(10.0)
            during = len(done) - down_from
            server.start()  # same port, empty: nothing was persisted
            time.sleep(2.0)
            stop.set()
            thread.join(timeout=60)
        assert not failures, failures[:3]
        assert during > 0, "requests kept completing while Redis was down"
        # Stats resume: the registry entry, the iteration stream and request stats are back.
        r = s.redis
        deadline = time.monotonic() + 10
        while not (r.exists(s.keys.worker(s.workers[0].worker_id)) and r.xlen(stream_key) > 0):
            assert time.monotonic() < deadline, "worker stats did not resume after the restart"
            time.sleep(0.1)
        assert s.request_stats(done[-1])["finish_reason"] == "length"
        assert "redis: lost" in s.workers[0].log()
        assert "redis: connected" in s.workers[0].log()
