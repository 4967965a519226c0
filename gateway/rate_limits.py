"""Per-API-key limits over every gateway, kept in Redis: requests in flight,
requests per minute and tokens (prompt and output) per minute; and each key's
usage (requests, tokens in and out) in Redis and on /metrics.

A request's admission is one Redis script call (atomic across gateways); its end
one pipeline, sent after its response. A key without limits never waits on
Redis; a key refused for its rate is refused here, without Redis, until the
time its refusal named.

The per-minute counts are a sliding window: this minute's count plus the last
minute's weighted by the part of it still inside the window (60 s back).
In flight, a request holds a lease in a sorted set, renewed while it runs: a
gateway that dies leaves nothing counted longer than LEASE_S.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

import protocol
from ops.metrics import GatewayMetrics
from protocol.api_keys import ApiKeyRecord
from protocol.keys import RATE_WINDOW_TTL_S

log = logging.getLogger(__name__)

LEASE_S = 60.0
_RENEW_S = LEASE_S / 3

# KEYS: in flight, requests this minute, last minute, tokens this minute, last minute.
# ARGV: now, lease end, request id, max concurrent, requests/min, tokens/min (0: none),
# the last minute's weight, the windows' TTL.
_ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local inflight = redis.call('ZCARD', KEYS[1])
local w = tonumber(ARGV[7])
local req = tonumber(redis.call('GET', KEYS[2]) or '0') + math.floor(tonumber(redis.call('GET', KEYS[3]) or '0') * w)
local tok = tonumber(redis.call('GET', KEYS[4]) or '0') + math.floor(tonumber(redis.call('GET', KEYS[5]) or '0') * w)
local maxc, rpm, tpm = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if maxc > 0 and inflight >= maxc then return {1, inflight, req, tok} end
if rpm > 0 and req >= rpm then return {2, inflight, req, tok} end
if tpm > 0 and tok >= tpm then return {3, inflight, req, tok} end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) - tonumber(ARGV[1])))
redis.call('INCR', KEYS[2])
redis.call('EXPIRE', KEYS[2], ARGV[8])
return {0, inflight + 1, req + 1, tok}
"""
_LIMITS = {1: "concurrent requests", 2: "requests per minute", 3: "tokens per minute"}


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is over its key's limits, as OpenAI's 429 says it."""

    message: str
    limit: str  # which: concurrent requests, requests per minute, tokens per minute
    retry_after_s: int
    headers: dict[str, str]


class RateLimits:
    """Used from the HTTP front's event loop only."""

    def __init__(self, redis_url: str, keys: protocol.Keys, metrics: GatewayMetrics) -> None:
        self._redis_url = redis_url
        self._keys = keys
        self._metrics = metrics
        self._redis: aioredis.Redis | None = None  # made on the loop that uses it
        self._blocked: dict[str, tuple[float, Refusal]] = {}  # key name -> (until, refusal): the fast path
        self._leases: dict[str, str] = {}  # request id -> key name, while it runs
        self._renew: asyncio.Task[None] | None = None

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            self._redis = aioredis.Redis.from_url(self._redis_url, socket_timeout=2.0)
        return self._redis

    async def admit(self, record: ApiKeyRecord, request_id: str) -> Refusal | None:
        """None: go on (then call `done`); else the refusal to answer with."""
        limits = record.limits
        if limits.max_concurrent is None and limits.requests_per_minute is None and limits.tokens_per_minute is None:
            return None
        now = time.time()
        blocked = self._blocked.get(record.name)
        if blocked is not None and now < blocked[0]:
            self._metrics.api_key_refused.labels(record.name, blocked[1].limit).inc()
            return blocked[1]
        minute = int(now // 60)
        weight = 1.0 - (now % 60) / 60
        name = record.name
        k = self._keys
        try:
            status, inflight, requests, tokens = await self._client().eval(
                _ADMIT, 5, k.api_key_in_flight(name), k.api_key_requests(name, minute),
                k.api_key_requests(name, minute - 1), k.api_key_tokens(name, minute),
                k.api_key_tokens(name, minute - 1),
                now, now + LEASE_S, request_id, limits.max_concurrent or 0, limits.requests_per_minute or 0,
                limits.tokens_per_minute or 0, weight, RATE_WINDOW_TTL_S,
            )  # fmt: skip
        except RedisError as e:
            # Limits need Redis; without it a key is served unlimited rather than not at all.
            log.warning("cannot check the limits of API key %s: %s", name, e)
            return None
        if status == 0:
            self._leases[request_id] = name
            if self._renew is None:
                self._renew = asyncio.create_task(self._renew_leases())
            return None
        reset_s = max(1, math.ceil(60 - now % 60))
        retry = 1 if status == 1 else reset_s
        headers = {"retry-after": str(retry)}
        if limits.requests_per_minute is not None:
            headers |= {"x-ratelimit-limit-requests": str(limits.requests_per_minute),
                        "x-ratelimit-remaining-requests": str(max(0, limits.requests_per_minute - requests)),
                        "x-ratelimit-reset-requests": f"{reset_s}s"}  # fmt: skip
        if limits.tokens_per_minute is not None:
            headers |= {"x-ratelimit-limit-tokens": str(limits.tokens_per_minute),
                        "x-ratelimit-remaining-tokens": str(max(0, limits.tokens_per_minute - tokens)),
                        "x-ratelimit-reset-tokens": f"{reset_s}s"}  # fmt: skip
        what = _LIMITS[status]
        limit = {1: limits.max_concurrent, 2: limits.requests_per_minute, 3: limits.tokens_per_minute}[status]
        refusal = Refusal(f"Rate limit reached for API key {name!r} on {what}: limit {limit}, used "
                          f"{[inflight, requests, tokens][status - 1]}. Please try again in {retry}s.",
                          what, retry, headers)  # fmt: skip
        if status != 1:  # a slot in flight may free at any moment; a minute's count only with time
            self._blocked[name] = (now + retry, refusal)
        self._metrics.api_key_refused.labels(name, what).inc()
        return refusal

    async def done(self, record: ApiKeyRecord, request_id: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A request of `record`'s key ended with these tokens served: its usage counted."""
        name = record.name
        self._leases.pop(request_id, None)
        self._metrics.api_key_tokens.labels(name, "in").inc(prompt_tokens)
        self._metrics.api_key_tokens.labels(name, "out").inc(completion_tokens)
        self._metrics.api_key_requests.labels(name).inc()
        k = self._keys
        tokens_key = k.api_key_tokens(name, int(time.time() // 60))
        try:
            async with self._client().pipeline(transaction=False) as pipe:
                pipe.zrem(k.api_key_in_flight(name), request_id)
                pipe.hincrby(k.api_key_usage(name), "requests", 1)
                pipe.hincrby(k.api_key_usage(name), "prompt_tokens", prompt_tokens)
                pipe.hincrby(k.api_key_usage(name), "completion_tokens", completion_tokens)
                pipe.incrby(tokens_key, prompt_tokens + completion_tokens)
                pipe.expire(tokens_key, RATE_WINDOW_TTL_S)
                await pipe.execute()
        except RedisError as e:
            log.warning("cannot count the usage of API key %s: %s", name, e)

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(_RENEW_S)
            if not self._leases:
                continue
            until = time.time() + LEASE_S
            try:
                async with self._client().pipeline(transaction=False) as pipe:
                    for request_id, name in list(self._leases.items()):
                        pipe.zadd(self._keys.api_key_in_flight(name), {request_id: until}, xx=True)
                    await pipe.execute()
            except RedisError as e:
                log.warning("cannot renew the leases of requests in flight: %s", e)

    async def close(self) -> None:
        if self._renew is not None:
            self._renew.cancel()
        if self._redis is not None:
            await self._redis.aclose()
