"""kill -9 of a worker, kill -9 of a gateway, Redis down for 10 s: what the
clients and the surviving processes see (DESIGN.md §5, promises 2-4)."""

from __future__ import annotations

import threading
import time

from clients.client import Client, FinishReason
from tests.procs import CLIENT_OPTIONS, stack


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
            lock = threading.Lock()

            def follow(f):
                for _ in f:
                    with lock:
                        firsts.setdefault(f.request_id, time.monotonic())

            threads = [threading.Thread(target=follow, args=(f,)) for f in futures]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 20
            while len(firsts) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(firsts) == 4, "two requests running on each worker"
            s.workers[0].kill9()
            for t in threads:
                t.join(timeout=60)

        # Each goes on through the other worker (tests/integration/test_migration.py checks the tokens).
        for f in futures:
            result = f.result(timeout=0)
            assert result.finish_reason == FinishReason.LENGTH
            assert len(result.token_ids) == 1500
        s.wait_idle(s.workers[1])
        log = s.gateways[0].log()
        assert log.count("continued on another worker") == 2, "the two started streams"
        assert log.count("restarted on another worker") == 1, "the killed worker's queued request"


def test_kill_gateway(long_model, redis_url, tmp_path, caplog):
    with stack(long_model, redis_url, tmp_path, workers=0, gateways=0) as s:
        worker = s.worker("--deterministic")  # the continuation runs beside other requests than before
        first, second = s.gateway(), s.gateway()
        first.wait_workers(1)
        second.wait_workers(1)
        request = {"max_tokens": 3000, "ignore_eos": True, "temperature": 1.0, "top_p": 0.9, "seed": 42}
        with Client([second.endpoint], **CLIENT_OPTIONS) as client:
            want = client.generate([30, 31, 32], timeout=120, **request)
        with Client([first.endpoint, second.endpoint], **CLIENT_OPTIONS) as client:
            future = client.stream([30, 31, 32], **request)
            chunks = iter(future)
            streamed = next(chunks).token_ids
            assert client.gateway == first.endpoint
            first.kill9()
            # The worker drops the orphan once the gateway's heartbeats stop.
            worker.wait_log("aborting its 1 requests", timeout=15)
            # The client: the stream goes on through the other gateway, as if nothing happened.
            for chunk in chunks:
                streamed += chunk.token_ids
            got = future.result(timeout=0)
            assert client.gateway == second.endpoint
        assert got.token_ids == want.token_ids, "the resumed stream differs from an undisturbed run"
        assert got.text == want.text
        assert streamed == want.token_ids, "the stream's chunks repeat or miss tokens"
        # Seen by the closed connection, not after the heartbeat bound.
        assert f"gateway {first.endpoint} lost (its connection closed)" in caplog.text
        s.wait_idle(worker)


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
