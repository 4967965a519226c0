"""Finds workers in the Redis registry, on its own thread, so a slow or absent
Redis never stalls the gateway's sockets. Connected workers stay connected
while Redis is down: liveness is judged by heartbeats on the data socket."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import redis

import protocol

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 5.0


class Discovery(threading.Thread):
    def __init__(
        self, url: str, keys: protocol.Keys, interval_s: float, stale_after_s: float, stop: threading.Event
    ) -> None:
        super().__init__(name="gateway-discovery", daemon=True)
        self.redis = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.keys = keys
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self.stop = stop
        # The newest registry snapshot: worker id -> (entry, unix time of its last heartbeat).
        self.snapshots: queue.Queue[dict[str, tuple[protocol.WorkerInfo, float]]] = queue.Queue(maxsize=1)
        self.connected = False  # Redis answered the last read

    def run(self) -> None:
        backoff = 0.2
        while not self.stop.is_set():
            try:
                snapshot = self._read()
                if not self.connected:
                    log.info("redis: connected")
                    self.connected = True
                backoff = 0.2
            except redis.RedisError as e:
                if self.connected:
                    log.warning("redis: lost (%s); keeping the workers already connected", e)
                else:  # repeated, as the retries back off: a gateway that never reached Redis finds no worker
                    log.warning("redis: cannot reach it (%s); no worker can be discovered; retrying in %.1f s", e,
                                backoff)  # fmt: skip
                self.connected = False
                self.stop.wait(backoff)
                backoff = min(_MAX_BACKOFF_S, backoff * 2)
                continue
            with contextlib.suppress(queue.Empty):
                self.snapshots.get_nowait()  # replace an unread older one
            self.snapshots.put(snapshot)
            self.stop.wait(self.interval_s)

    def _read(self) -> dict[str, tuple[protocol.WorkerInfo, float]]:
        entries: list[tuple[bytes, float]] = self.redis.zrangebyscore(  # type: ignore[assignment]
            self.keys.workers(), time.time() - self.stale_after_s, "+inf", withscores=True
        )
        if not entries:
            return {}
        ids = [raw.decode() for raw, _ in entries]
        keys = [self.keys.worker(i) for i in ids]
        blobs: list[bytes | None] = self.redis.mget(keys)  # type: ignore[assignment]
        found: dict[str, tuple[protocol.WorkerInfo, float]] = {}
        for worker_id, (_, score), blob in zip(ids, entries, blobs, strict=True):
            if blob is None:
                continue  # expired: the worker stopped refreshing it
            try:
                info = protocol.decode(bytes(blob))
            except protocol.ProtocolError as e:
                log.warning("registry entry of %s is unreadable: %s", worker_id, e)
                continue
            if isinstance(info, protocol.WorkerInfo):
                found[worker_id] = (info, float(score))
        return found
