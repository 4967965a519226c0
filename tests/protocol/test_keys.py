"""Redis key names, checked against a real Redis server."""

from __future__ import annotations

from typing import Any

import pytest
import redis

import protocol as p


def test_keys_live_under_the_prefix():
    keys = p.Keys("prod:tw")
    names = [
        keys.cancel("r1"),
        keys.workers(),
        keys.worker("w1"),
        keys.heartbeat("w1"),
        keys.iteration_stats("w1"),
        keys.request_stats("r1"),
        keys.jobs(),
        keys.jobs_dead_letter(),
        keys.job_result("j1"),
    ]
    assert all(name.startswith("prod:tw:") for name in names)
    assert len(set(names)) == len(names)
    assert p.Keys().cancel("r1") == "tokenwire:cancel:r1"


@pytest.mark.parametrize("prefix", ["", "a b", "tw:", ":tw", "tw*", "tw\n"])
def test_bad_prefix_is_refused(prefix: str):
    with pytest.raises(ValueError, match="prefix"):
        p.Keys(prefix)


def test_cancel_flag_with_ttl(redis_url: str):
    keys = p.Keys("t1")
    r = redis.Redis.from_url(redis_url)
    r.set(keys.cancel("req-9"), b"1", ex=p.CANCEL_TTL_S)
    assert r.exists(keys.cancel("req-9")) == 1
    ttl = r.ttl(keys.cancel("req-9"))
    assert 0 < ttl <= p.CANCEL_TTL_S
    assert r.exists(keys.cancel("req-10")) == 0


def test_registry_entry_round_trips_through_redis(redis_url: str):
    keys = p.Keys("t2")
    r = redis.Redis.from_url(redis_url)
    info = p.WorkerInfo(worker_id="w0", address="tcp://127.0.0.1:5600", models=["m"], host="h", pid=42, started_at=1.0)
    r.set(keys.worker("w0"), p.encode(info), ex=5)
    r.zadd(keys.workers(), {"w0": 100.0})
    stored = r.get(keys.worker("w0"))
    assert isinstance(stored, bytes)
    assert p.decode(stored) == info
    assert r.zrangebyscore(keys.workers(), 50, "+inf") == [b"w0"]
    r.xadd(keys.iteration_stats("w0"), {"data": p.encode(p.Heartbeat(sender_id="w0"))}, maxlen=10)
    entries: Any = r.xrange(keys.iteration_stats("w0"))
    ((_, fields),) = entries
    assert p.decode(fields[b"data"]) == p.Heartbeat(sender_id="w0")


def test_each_test_starts_with_an_empty_database(redis_url: str):
    assert redis.Redis.from_url(redis_url).dbsize() == 0


def test_dedicated_server_keeps_appendonly_data_across_restart(redis_server_factory):
    server = redis_server_factory(appendonly=True)
    r = redis.Redis.from_url(server.url)
    r.set(p.Keys().job_result("j1"), b"done")
    server.restart()
    assert redis.Redis.from_url(server.url).get(p.Keys().job_result("j1")) == b"done"
