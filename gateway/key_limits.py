"""Per-API-key limits and usage for both fronts, the HTTP front's middleware
(gateway/http_auth.py, on its own event loop's thread) and the ZeroMQ clients
(on the gateway's socket loop): requests in flight, requests per minute and
tokens (prompt and output) per minute; each key's usage in Redis and on /metrics.

Neither front waits on Redis: `admit` and `done` check and count in memory under
a lock held for those updates alone. A thread of its own syncs with Redis every
SYNC_S: it writes this gateway's leases of the requests in flight and the
requests and tokens counted since its last sync, and reads back each key's
totals over every gateway.

Consistency across gateways: a gateway sees another's admissions once that
one's sync has written them and its own next sync has read them, at most two
sync intervals (and a round trip) later. A limit therefore holds to within what
the other gateways admit for the key in that time, 2 * SYNC_S: with G gateways,
a key's count can exceed its limit by up to what G - 1 of them admit for it in
that time; on one gateway a limit holds exactly. While Redis does not answer, each
gateway holds the limits on its own counts and the totals it read last, and
writes its counts at the next sync that succeeds.

The per-minute counts are a sliding window: this minute's count plus the last
minute's weighted by the part of it still inside the window (60 s back). A
request in flight holds a lease in a sorted set, renewed while it runs: a
gateway that dies leaves nothing counted longer than LEASE_S.

A key this gateway has not served for IDLE_S (two windows), with nothing of it in
flight or left to write, is forgotten and no longer synced: with many keys, only
those in use cost a sync. Its next request starts from no counts until the sync
after it reads the key's totals again, within the bound above.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field

import redis

import protocol
from ops.metrics import GatewayMetrics
from protocol.api_keys import ApiKeyRecord
from protocol.keys import RATE_WINDOW_TTL_S

log = logging.getLogger(__name__)

SYNC_S = 0.1
LEASE_S = 60.0
IDLE_S = 120.0
# Only the sync thread waits on Redis, so it may wait long: a sync that timed out after
# Redis received it is applied once Redis answers, and would be counted again at the next.
SYNC_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is over its key's limits, as OpenAI's 429 says it."""

    message: str
    limit: str  # which: concurrent requests, requests per minute, tokens per minute
    retry_after_s: int
    headers: dict[str, str]  # retry-after and x-ratelimit-*


@dataclass(slots=True)
class _KeyState:
    in_flight: set[str] = field(default_factory=set)  # lease ids of this gateway's requests
    leased: set[str] = field(default_factory=set)  # those written to Redis at the last sync
    requests: int = 0  # started since the last sync
    tokens: int = 0  # prompt and output, of requests ended since the last sync
    usage: tuple[int, int, int] = (0, 0, 0)  # requests, prompt, completion tokens ended since the last sync
    # Read at the last sync: other gateways' requests in flight, and this minute's window
    # (this gateway's synced counts included).
    others_in_flight: int = 0
    window_requests: int = 0
    window_tokens: int = 0
    last_admitted: float = 0.0  # time.time() of this gateway's last request of the key


class KeyLimiter:
    """`admit` and `done` from either front's thread; the rest on the sync thread."""

    def __init__(self, redis_url: str, keys: protocol.Keys, metrics: GatewayMetrics, gateway_id: str,
                 idle_s: float = IDLE_S) -> None:  # fmt: skip
        self._redis_url = redis_url
        self._idle_s = idle_s
        self._keys = keys
        self._metrics = metrics
        self._gateway_id = gateway_id
        self._states: dict[str, _KeyState] = {}
        self._lock = threading.Lock()  # held for in-memory updates only, never over Redis
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-key-limits", daemon=True)
        self._renewed = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def admit(self, record: ApiKeyRecord, lease: str) -> Refusal | None:
        """None: go on (then call `done` with the same lease); else why it is refused."""
        now = time.time()
        limits = record.limits
        with self._lock:
            s = self._states.get(record.name)
            if s is None:
                s = self._states[record.name] = _KeyState()
            s.last_admitted = now
            in_flight = len(s.in_flight) + s.others_in_flight
            requests = s.window_requests + s.requests
            tokens = s.window_tokens + s.tokens
            if not (
                (limits.max_concurrent is not None and in_flight >= limits.max_concurrent)
                or (limits.requests_per_minute is not None and requests >= limits.requests_per_minute)
                or (limits.tokens_per_minute is not None and tokens >= limits.tokens_per_minute)
            ):
                s.in_flight.add(lease)
                s.requests += 1
                return None
        refusal = _refusal(record, now, in_flight, requests, tokens)
        self._metrics.api_key_refused.labels(record.name, refusal.limit).inc()
        return refusal

    def done(self, record: ApiKeyRecord, lease: str, prompt_tokens: int, completion_tokens: int) -> None:
        """An admitted request ended with these tokens served: counted here, in Redis at the next sync."""
        self._metrics.api_key_tokens.labels(record.name, "in").inc(prompt_tokens)
        self._metrics.api_key_tokens.labels(record.name, "out").inc(completion_tokens)
        self._metrics.api_key_requests.labels(record.name).inc()
        with self._lock:
            s = self._states[record.name]
            s.in_flight.discard(lease)
            s.tokens += prompt_tokens + completion_tokens
            r, p, c = s.usage
            s.usage = (r + 1, p + prompt_tokens, c + completion_tokens)

    # -- the sync thread -------------------------------------------------------------------

    def _run(self) -> None:
        client = redis.Redis.from_url(self._redis_url, socket_timeout=SYNC_TIMEOUT_S)
        try:
            while not self._stop.wait(SYNC_S):
                try:
                    self._sync(client)
                except redis.RedisError as e:
                    # Limits need Redis; without it keys are served on the last totals read.
                    log.warning("cannot sync API key limits with Redis: %s", e)
            try:
                self._sync(client)  # the last usage counted
            except redis.RedisError as e:
                log.warning("cannot write the last API key usage to Redis: %s", e)
        finally:
            client.close()

    def _sync(self, client: redis.Redis) -> None:
        now = time.time()
        renew = now - self._renewed > LEASE_S / 3
        with self._lock:  # take the deltas; the fronts count anew meanwhile
            taken = []
            for name, s in list(self._states.items()):
                if _idle(s, now - self._idle_s):
                    del self._states[name]  # nothing of it left to write, and its windows have passed
                    continue
                taken.append((name, set(s.in_flight), s.leased, s.requests, s.tokens, s.usage))
                s.requests, s.tokens, s.usage = 0, 0, (0, 0, 0)
        if not taken:
            return
        minute = int(now // 60)
        weight = 1.0 - (now % 60) / 60
        k = self._keys
        prefix = f"{self._gateway_id}:"
        pipe = client.pipeline(transaction=False)
        reads: list[int] = []  # where each key's in-flight count is among the replies (its windows next)
        for name, in_flight, leased, requests, tokens, (n, prompt, completion) in taken:
            zset = k.api_key_in_flight(name)
            fresh = in_flight if renew else in_flight - leased
            if fresh:
                pipe.zadd(zset, {prefix + lease: now + LEASE_S for lease in fresh})
                pipe.expire(zset, math.ceil(LEASE_S))
            if leased - in_flight:
                pipe.zrem(zset, *(prefix + lease for lease in leased - in_flight))
            if requests:
                pipe.incrby(k.api_key_requests(name, minute), requests)
                pipe.expire(k.api_key_requests(name, minute), RATE_WINDOW_TTL_S)
            if tokens:
                pipe.incrby(k.api_key_tokens(name, minute), tokens)
                pipe.expire(k.api_key_tokens(name, minute), RATE_WINDOW_TTL_S)
            if n:
                pipe.hincrby(k.api_key_usage(name), "requests", n)
                pipe.hincrby(k.api_key_usage(name), "prompt_tokens", prompt)
                pipe.hincrby(k.api_key_usage(name), "completion_tokens", completion)
            pipe.zremrangebyscore(zset, "-inf", now)
            reads.append(len(pipe))
            pipe.zcard(zset)
            pipe.mget(k.api_key_requests(name, minute), k.api_key_requests(name, minute - 1),
                      k.api_key_tokens(name, minute), k.api_key_tokens(name, minute - 1))  # fmt: skip
        try:
            replies = pipe.execute()
        except redis.RedisError:
            with self._lock:  # counted again at the next sync
                for name, _, _, requests, tokens, (n, prompt, completion) in taken:
                    s = self._states[name]
                    r, p, c = s.usage
                    s.requests += requests
                    s.tokens += tokens
                    s.usage = (r + n, p + prompt, c + completion)
            raise
        if renew:
            self._renewed = now
        with self._lock:
            for (name, in_flight, _, _, _, _), at in zip(taken, reads, strict=True):
                count, window = replies[at], replies[at + 1]
                s = self._states[name]
                s.leased = in_flight
                s.others_in_flight = max(0, count - len(in_flight))
                req_now, req_last, tok_now, tok_last = (int(v or 0) for v in window)
                s.window_requests = req_now + math.floor(req_last * weight)
                s.window_tokens = tok_now + math.floor(tok_last * weight)


def _idle(s: _KeyState, since: float) -> bool:
    """Nothing of this key in flight, leased or left to write, and no request since `since`."""
    return not (s.in_flight or s.leased or s.requests or s.tokens or any(s.usage)) and s.last_admitted < since


def _refusal(record: ApiKeyRecord, now: float, in_flight: int, requests: int, tokens: int) -> Refusal:
    """The first of `record`'s limits these counts reach, with OpenAI's headers."""
    limits = record.limits
    reset_s = max(1, math.ceil(60 - now % 60))
    if limits.max_concurrent is not None and in_flight >= limits.max_concurrent:
        what, limit, used, retry = "concurrent requests", limits.max_concurrent, in_flight, 1
    elif limits.requests_per_minute is not None and requests >= limits.requests_per_minute:
        what, limit, used, retry = "requests per minute", limits.requests_per_minute, requests, reset_s
    else:
        assert limits.tokens_per_minute is not None
        what, limit, used, retry = "tokens per minute", limits.tokens_per_minute, tokens, reset_s
    headers = {"retry-after": str(retry)}
    if limits.requests_per_minute is not None:
        headers |= {"x-ratelimit-limit-requests": str(limits.requests_per_minute),
                    "x-ratelimit-remaining-requests": str(max(0, limits.requests_per_minute - requests)),
                    "x-ratelimit-reset-requests": f"{reset_s}s"}  # fmt: skip
    if limits.tokens_per_minute is not None:
        headers |= {"x-ratelimit-limit-tokens": str(limits.tokens_per_minute),
                    "x-ratelimit-remaining-tokens": str(max(0, limits.tokens_per_minute - tokens)),
                    "x-ratelimit-reset-tokens": f"{reset_s}s"}  # fmt: skip
    message = (f"Rate limit reached for API key {record.name!r} on {what}: limit {limit}, used {used}; "
               f"retry after {retry} s.")  # fmt: skip
    return Refusal(message, what, retry, headers)
