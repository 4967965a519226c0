"""The worker's only Redis user, on its own thread: registry entry and heartbeat
key, cancel-flag polling, iteration and request stats.

Redis is not on the token path. When it is down this thread backs off and
retries; request stats wait in a bounded queue (dropped beyond it) and the
engine's bounded iteration-stats buffer holds the newest records.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

import protocol
from worker.service.active import ActiveTable
from worker.service.engine import EngineProcess

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 5.0
_MGET_CHUNK = 1000
_STATS_KEPT = 10_000  # request stats records waiting for Redis, at most: beyond, new ones are dropped
_STATS_PER_WRITE = 1000


class WorkerRedis(threading.Thread):
    def __init__(
        self,
        url: str,
        keys: protocol.Keys,
        info: protocol.WorkerInfo,
        engine: EngineProcess,
        table: ActiveTable,
        load: Callable[[], protocol.WorkerLoad],
        *,
        heartbeat_interval_s: float,
        cancel_poll_interval_s: float,
        stats_stream_maxlen: int,
        request_stats_ttl_s: float,
        stop: threading.Event,
    ) -> None:
        super().__init__(name="worker-redis", daemon=True)
        self.redis = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.keys = keys
        self.info = info
        self.engine = engine
        self.table = table
        self.load = load
        self.heartbeat_interval_s = heartbeat_interval_s
        self.cancel_poll_interval_s = cancel_poll_interval_s
        self.stats_stream_maxlen = stats_stream_maxlen
        self.request_stats_ttl_ms = int(request_stats_ttl_s * 1000)
        self.stop = stop
        # Request stats records waiting to be written (request name, fields), from the result pump.
        self._request_stats: list[tuple[str, dict[str, str]]] = []
        self._stats_lock = threading.Lock()
        self.connected = False
        # Set when the worker drains: leave the registry at once and stop heartbeating there.
        self.leave = threading.Event()
        self._left = False
        # A registry entry outlives three missed heartbeats, no more.
        self._ttl_ms = int(max(3.0, 3 * heartbeat_interval_s) * 1000)

    def record_requests(self, records: list[tuple[str, dict[str, str]]]) -> None:
        """The stats records of requests that ended (request name, fields), written with the
        next batch; called from the result pump, never blocks."""
        with self._stats_lock:
            room = _STATS_KEPT - len(self._request_stats)
            self._request_stats += records[: max(0, room)]
        dropped = [name for name, _ in records[max(0, room) :]]
        if dropped:  # Redis has been away for _STATS_KEPT requests
            log.warning("the stats of %d requests are dropped (Redis unreachable, the stats queue is full): %s",
                        len(dropped), ", ".join(dropped[:5]) + (", ..." if len(dropped) > 5 else ""))  # fmt: skip

    def run(self) -> None:
        backoff = 0.2
        next_heartbeat = 0.0
        while not self.stop.is_set():
            try:
                now = time.monotonic()
                if self.leave.is_set():
                    if not self._left:
                        self._left = self._deregister()
                elif now >= next_heartbeat:
                    self._heartbeat()
                    next_heartbeat = now + self.heartbeat_interval_s
                self._poll_cancels()
                self._write_stats()
                if not self.connected:
                    log.info("redis: connected")
                    self.connected = True
                backoff = 0.2
                self.stop.wait(self.cancel_poll_interval_s)
            except redis.RedisError as e:
                if self.connected:
                    log.warning("redis: lost (%s); serving on, retrying with backoff", e)
                else:  # repeated, as the retries back off: never registered, no gateway finds this worker
                    log.warning("redis: cannot reach it (%s); not registered, so no gateway can find this worker; "
                                "retrying in %.1f s", e, backoff)  # fmt: skip
                self.connected = False
                next_heartbeat = 0.0  # re-register as soon as it is back
                self.stop.wait(backoff)
                backoff = min(_MAX_BACKOFF_S, backoff * 2)
        self._flush_stats()
        self._deregister()

    def _flush_stats(self) -> None:
        """At exit: write what the queue still holds (a drain's last requests), a few tries at most."""
        for _ in range(3):
            try:
                while self._request_stats:
                    self._write_stats()
                return
            except redis.RedisError as e:
                log.warning("redis: request stats not written at exit (%s)", e)
                time.sleep(0.2)

    def _heartbeat(self) -> None:
        beat = protocol.Heartbeat(sender_id=self.info.worker_id, load=self.load())
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.worker(self.info.worker_id), protocol.encode(self.info), px=self._ttl_ms)
        pipe.set(self.keys.heartbeat(self.info.worker_id), protocol.encode(beat), px=self._ttl_ms)
        pipe.zadd(self.keys.workers(), {self.info.worker_id: time.time()})
        pipe.execute()

    def _poll_cancels(self) -> None:
        active = [a for a in self.table.snapshot() if not a.cancelled]
        for start in range(0, len(active), _MGET_CHUNK):
            chunk = active[start : start + _MGET_CHUNK]
            flags = self.redis.mget([self.keys.cancel(a.name) for a in chunk])
            for entry, flag in zip(chunk, flags, strict=True):
                if flag is not None:
                    log.info("request %s: cancel flag set in redis", entry.name)
                    entry.cancelled = True
                    self.engine.cancel_request(entry.exec_id)

    def _write_stats(self) -> None:
        iterations = self.engine.get_latest_iteration_stats()
        with self._stats_lock:
            pending = self._request_stats[:_STATS_PER_WRITE]
            del self._request_stats[:_STATS_PER_WRITE]
        if not iterations and not pending:
            return
        pipe = self.redis.pipeline(transaction=False)
        stream = self.keys.iteration_stats(self.info.worker_id)
        for it in iterations:
            fields: dict[Any, Any] = {f.name: str(getattr(it, f.name)) for f in dataclasses.fields(it)}
            pipe.xadd(stream, fields, maxlen=self.stats_stream_maxlen, approximate=True)
        for request_id, fields in pending:
            key = self.keys.request_stats(request_id)
            pipe.hset(key, mapping=dict[Any, Any](fields))
            pipe.pexpire(key, self.request_stats_ttl_ms)
        try:
            pipe.execute()
        except redis.RedisError:
            self.record_requests(pending)  # kept for the next try, within the bound
            raise

    def _deregister(self) -> bool:
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(self.keys.worker(self.info.worker_id), self.keys.heartbeat(self.info.worker_id))
            pipe.zrem(self.keys.workers(), self.info.worker_id)
            pipe.execute()
        except redis.RedisError as e:
            log.warning("redis: could not deregister (%s); the entry expires on its own", e)
            return False
        log.info("redis: left the worker registry")
        return True
