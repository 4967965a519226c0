"""The API key limiter (gateway/key_limits.py) against a real Redis: a key no request has
used for its idle time is forgotten, so the sync stops reading it; its next request is
admitted and counted as before."""

from __future__ import annotations

import time

import redis

import protocol
from gateway.key_limits import SYNC_S, KeyLimiter
from ops.metrics import GatewayMetrics
from protocol.api_keys import ApiKeyRecord, KeyLimits

IDLE_S = 1.5


def mget_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_mget", {}).get("calls", 0))


def test_an_idle_key_stops_being_synced_and_counts_again_when_used(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    keys = protocol.Keys()
    limiter = KeyLimiter(redis_url, keys, GatewayMetrics(), "gw-idle", idle_s=IDLE_S)
    record = ApiKeyRecord(name="idle", limits=KeyLimits(requests_per_minute=1000))
    limiter.start()
    try:
        assert limiter.admit(record, "a") is None
        limiter.done(record, "a", 3, 4)
        time.sleep(2 * SYNC_S)
        before = mget_calls(client)
        time.sleep(3 * SYNC_S)
        assert mget_calls(client) > before  # in use: its totals are read at every sync

        time.sleep(IDLE_S)
        before = mget_calls(client)
        time.sleep(5 * SYNC_S)
        assert mget_calls(client) == before  # idle: no longer read

        assert limiter.admit(record, "b") is None
        limiter.done(record, "b", 5, 6)
        time.sleep(5 * SYNC_S)
        raw: dict[bytes, bytes] = client.hgetall(keys.api_key_usage("idle"))  # type: ignore[assignment]
        usage = {k.decode(): int(v) for k, v in raw.items()}
        assert usage == {"requests": 2, "prompt_tokens": 8, "completion_tokens": 10}
    finally:
        limiter.stop()
        client.close()
