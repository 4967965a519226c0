"""The job consumer: its own process (`tokenwire jobs consume`), any number of them.

Each consumer reads the jobs stream through one consumer group and submits jobs
to gateways like any client (one ZeroMQ connection, the client library's I/O
thread), so it needs no GPU and no model. It keeps at most as many jobs in
flight as the live workers have free batch slots (their registry entries and
heartbeats in Redis), capped by `max_in_flight`; with no live worker it takes
nothing, and jobs wait in the stream.

Delivery is at least once. A job's stream entry is acknowledged only after its
result is written (one script, clients/job_scripts.py). While a job runs, its
consumer re-claims the entry every `idle_timeout_s / 3` so that it never looks
idle; a consumer that dies stops doing so, and after `idle_timeout_s` another
consumer takes the entry over with XAUTOCLAIM and runs the job again. A failed
delivery (an error from the service) leaves the entry pending, so it too is
retried after the idle timeout. Every delivery is counted in the job's hash; a
job that fails on its `max_deliveries`-th delivery, or is delivered more often
than that (it keeps killing consumers), goes to the dead-letter stream with its
last error. Results are idempotent: the first to end a job wins.

Redis outages are waited out with backoff: jobs in flight keep running, and
their results are written once Redis is back.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

import protocol
from clients.connection import Connection, RequestError
from clients.job_scripts import Scripts, ensure_group
from clients.wire import Accumulator
from ops.curve import ClientCurve
from ops.sd_notify import Notifier
from ops.secrets import redact
from protocol import FinishReason, Keys
from protocol.jobs import Job, JobOutput, JobResult, JobStatus, pack, unpack_job

log = logging.getLogger(__name__)

_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
# Batch slots assumed for a worker whose registry entry does not say.
_DEFAULT_SLOTS = 8


@dataclass(slots=True)
class ConsumerConfig:
    redis_url: str
    gateways: list[str]
    prefix: str = protocol.DEFAULT_PREFIX
    name: str = ""  # default host-pid; a restarted consumer may reuse its name
    max_in_flight: int = 256
    idle_timeout_s: float = 30.0  # a pending job untouched this long is taken over
    max_deliveries: int = 5
    capacity_interval_s: float = 0.25  # how often the workers' load is read
    heartbeat_interval_s: float = 1.0  # to the gateway
    missed_heartbeats: int = 3
    drain_timeout_s: float = 10.0  # on SIGTERM, how long jobs in flight may take to end
    curve: ClientCurve | None = None  # CURVE to the gateways; None: off


@dataclass(slots=True)
class _Running:
    entry_id: str
    job: Job
    deliveries: int
    started: float
    stopped: bool = False  # cancelled by us (deadline)


@dataclass(slots=True)
class _Ended:
    """A job's outcome, waiting for Redis to record it."""

    entry_id: str
    job_id: str
    result: JobResult | None  # None: the job had ended already; only acknowledge its entry
    error: str
    retry: bool  # a failed delivery to be retried, not a final status
    ttl_s: int


class _JobSink:
    """Collects one job's responses on the client I/O thread; hands the end to the consumer."""

    def __init__(self, job_id: str, num_sequences: int, done: queue.SimpleQueue[tuple[str, Any]]) -> None:
        self.job_id = job_id
        self.acc = Accumulator(job_id, num_sequences)
        self.done = done

    def on_response(self, response: protocol.Response) -> None:
        self.acc.add(response)
        if response.is_final:
            self.done.put((self.job_id, self.acc.result))

    def on_error(self, error: RequestError) -> None:
        self.done.put((self.job_id, error))


class Consumer:
    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config
        self.name = config.name or f"{socket.gethostname()}-{os.getpid()}"
        self.keys = Keys(config.prefix)
        self.redis: Any = redis.Redis.from_url(config.redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.scripts = Scripts(self.redis, self.keys)
        self.stop = threading.Event()
        self.notifier = Notifier(address="")  # the process's own under systemd (tokenwire jobs consume)
        self._running: dict[str, _Running] = {}
        self._ended: list[_Ended] = []  # recorded once Redis answers
        self._done: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._budget = 0
        self._claim_cursor: bytes | str = "0-0"
        self._connection: Connection | None = None

    def run(self) -> None:
        self._connection = Connection(
            self.config.gateways,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            missed_heartbeats=self.config.missed_heartbeats,
            connect_attempts=None,  # jobs wait for a gateway rather than spend their deliveries
            curve=self.config.curve,
        )
        log.info("consumer %s: gateways %s, redis %s", self.name, self.config.gateways, redact(self.config.redis_url))
        next_capacity = next_refresh = next_claim = 0.0
        backoff = 0.1
        group_ready = False
        try:
            while not self.stop.is_set():
                self.notifier.watchdog()
                self._collect(wait_s=0.02 if self._running else 0.0)
                try:
                    if not group_ready:
                        ensure_group(self.redis, self.keys)
                        group_ready = True
                        self.notifier.ready(f"consumer {self.name}: Redis reached, gateways {self.config.gateways}")
                    self._record_ended()
                    now = time.monotonic()
                    if now >= next_capacity:
                        self._budget = self._capacity()
                        next_capacity = now + self.config.capacity_interval_s
                    if now >= next_refresh:
                        self._refresh()
                        next_refresh = now + self.config.idle_timeout_s / 3
                    if now >= next_claim:
                        self._claim()
                        next_claim = now + min(1.0, self.config.idle_timeout_s / 3)
                    self._read()
                    backoff = 0.1
                except _REDIS_DOWN as e:
                    log.warning("consumer %s: Redis unavailable (%s); retrying in %.1f s", self.name, e, backoff)
                    self.stop.wait(backoff)
                    backoff = min(5.0, backoff * 2)
                except redis.ResponseError as e:
                    if "NOGROUP" not in str(e):
                        raise
                    group_ready = False  # Redis lost the stream (restarted without persistence)
            self.notifier.stopping(f"consumer {self.name}: draining {len(self._running)} jobs in flight")
            self._drain()
        finally:
            self._connection.close()
            self.redis.close()

    def _drain(self) -> None:
        """On stop: take nothing new, let the jobs in flight end (within
        drain_timeout_s) and record them; the rest stay pending for others."""
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self._running and time.monotonic() < deadline:
            self._collect(wait_s=0.05)
        try:
            self._record_ended()
        except _REDIS_DOWN as e:
            log.warning("consumer %s: could not record %d ended jobs: %s", self.name, len(self._ended), e)
        if self._running:
            left = len(self._running)
            log.warning("consumer %s: %d jobs still running at exit; others take them over", self.name, left)
        else:
            log.info("consumer %s: stopped with no job in flight", self.name)

    # -- capacity ---------------------------------------------------------------------------

    def _capacity(self) -> int:
        """How many jobs this consumer may have in flight: its own plus the free
        batch slots of live workers, at most max_in_flight."""
        ids = [raw.decode() for raw in self.redis.zrange(self.keys.workers(), 0, -1)]
        if not ids:
            return 0
        blobs = self.redis.mget([k for w in ids for k in (self.keys.worker(w), self.keys.heartbeat(w))])
        free = 0
        for info_blob, beat_blob in zip(blobs[::2], blobs[1::2], strict=True):
            if info_blob is None:
                continue  # registry entry expired: the worker is gone
            info = protocol.decode(info_blob)
            if not isinstance(info, protocol.WorkerInfo) or info.state != "serving":
                continue
            beat = protocol.decode(beat_blob) if beat_blob is not None else None
            load = beat.load if isinstance(beat, protocol.Heartbeat) and beat.load else protocol.WorkerLoad()
            if load.max_num_blocks and not load.free_num_blocks:
                continue
            slots = info.max_batch_size or _DEFAULT_SLOTS
            free += max(0, slots - load.num_active_requests - load.num_queued_requests)
        return min(self.config.max_in_flight, len(self._running) + free)

    # -- taking jobs --------------------------------------------------------------------------

    def _read(self) -> None:
        room = self._budget - len(self._running)
        if room <= 0:
            if not self._running:
                self.stop.wait(0.05)
            return
        block = None if self._running else 50
        reply = self.redis.xreadgroup(
            self.keys.jobs_group(), self.name, {self.keys.jobs(): ">"}, count=room, block=block
        )
        self._start([(e.decode(), f.get(b"job_id", b"").decode()) for _, entries in reply or [] for e, f in entries])

    def _claim(self) -> None:
        """Take over jobs pending longer than the idle timeout (their consumer died,
        or their last delivery failed)."""
        room = self._budget - len(self._running)
        if room <= 0:
            return
        idle_ms = int(self.config.idle_timeout_s * 1000)
        reply = self.redis.xautoclaim(
            self.keys.jobs(), self.keys.jobs_group(), self.name, idle_ms, start_id=self._claim_cursor, count=room
        )
        self._claim_cursor = reply[0]  # where the next scan of the pending list goes on ("0-0": from the top)
        taken = []
        for entry_id, fields in reply[1]:
            if fields is None:
                continue  # deleted meanwhile
            job_id = fields.get(b"job_id", b"").decode()
            if job_id not in self._running:  # else ours already (its refresh was late)
                taken.append((entry_id.decode(), job_id))
        if taken:
            log.info("consumer %s: took over %d jobs, e.g. %s", self.name, len(taken), taken[0][1])
            self._start(taken)

    def _refresh(self) -> None:
        """Touch our pending entries so no other consumer takes them over."""
        if self._running:
            ids = [r.entry_id for r in self._running.values()]
            self.redis.xclaim(self.keys.jobs(), self.keys.jobs_group(), self.name, 0, ids, justid=True)
        now = time.time()
        assert self._connection is not None
        for job_id, run in self._running.items():
            if run.job.deadline is not None and now > run.job.deadline and not run.stopped:
                run.stopped = True
                self._connection.cancel(job_id)

    def _start(self, entries: list[tuple[str, str]]) -> None:
        """Deliver (entry id, job id) pairs: count each delivery, then run the job
        or end it (cancelled, expired, delivered too often)."""
        if not entries:
            return
        pipe = self.redis.pipeline(transaction=False)
        for _, job_id in entries:
            self.scripts.start(keys=[self.keys.job(job_id)], args=[self.name, time.time()], client=pipe)
        now = time.time()
        for (entry_id, job_id), reply in zip(entries, pipe.execute(), strict=True):
            if reply[0] != b"start":
                # Ended already (e.g. cancelled while queued) or unknown: only acknowledge it.
                self._ended.append(_Ended(entry_id, job_id, None, "", False, 1))
                continue
            deliveries, blob, cancel, last_error = int(reply[1]), reply[2], reply[3], reply[4].decode()
            job = unpack_job(blob)
            if cancel:
                self._end(entry_id, job, deliveries, JobStatus.CANCELLED)
            elif job.deadline is not None and now > job.deadline:
                self._end(entry_id, job, deliveries, JobStatus.EXPIRED, "deadline passed before the job ran")
            elif deliveries > self.config.max_deliveries:
                last = last_error or "none (its consumers died)"
                self._end(
                    entry_id, job, deliveries, JobStatus.DEAD, f"delivered {deliveries} times; last error: {last}"
                )
            else:
                assert self._connection is not None
                self._running[job_id] = _Running(entry_id, job, deliveries, time.monotonic())
                sink = _JobSink(job_id, job.submit.num_return_sequences, self._done)
                self._connection.submit(job.submit, protocol.encode(job.submit), sink)

    # -- ending jobs --------------------------------------------------------------------------

    def _collect(self, wait_s: float) -> None:
        """Turn finished requests into job outcomes."""
        try:
            item = self._done.get(timeout=wait_s) if wait_s else self._done.get_nowait()
        except queue.Empty:
            return
        while True:
            job_id, outcome = item
            run = self._running.pop(job_id, None)
            if run is not None:
                self._outcome(job_id, run, outcome)
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                return

    def _outcome(self, job_id: str, run: _Running, outcome: Any) -> None:
        if isinstance(outcome, RequestError):
            error = str(outcome)
            if run.deliveries >= self.config.max_deliveries:
                self._end(run.entry_id, run.job, run.deliveries, JobStatus.DEAD, error)
            else:
                log.info("consumer %s: job %s failed (delivery %d): %s", self.name, job_id, run.deliveries, error)
                result = JobResult(job_id=job_id, status=JobStatus.QUEUED, finished_at=time.time())
                self._ended.append(_Ended(run.entry_id, job_id, result, error, True, run.job.result_ttl_s))
            return
        outputs = [
            JobOutput(
                text=o.text,
                token_ids=o.token_ids,
                finish_reason=o.finish_reason.name.lower() if o.finish_reason is not None else None,
                tool_calls=o.tool_calls,
            )
            for o in outcome.outputs
        ]
        if outcome.embedding is not None:
            outputs = [JobOutput(embedding=outcome.embedding.tolist())]
        status = JobStatus.DONE
        error = ""
        if outcome.finish_reason == FinishReason.CANCELLED:
            if run.stopped:
                status, error = JobStatus.EXPIRED, "deadline passed while the job ran"
            else:
                status = JobStatus.CANCELLED  # by its cancel flag: nothing else cancels a job's request
        self._end(run.entry_id, run.job, run.deliveries, status, error, outputs)

    def _end(
        self,
        entry_id: str,
        job: Job,
        deliveries: int,
        status: JobStatus,
        error: str = "",
        outputs: list[JobOutput] | None = None,
    ) -> None:
        result = JobResult(
            job_id=job.job_id,
            status=status,
            outputs=outputs or [],
            error=error or None,
            deliveries=deliveries,
            submitted_at=job.submitted_at,
            finished_at=time.time(),
        )
        self._ended.append(_Ended(entry_id, job.job_id, result, error, False, job.result_ttl_s))

    def _record_ended(self) -> None:
        """Write every outcome in one pipeline. Each script is idempotent, so after
        a Redis error the whole batch is simply sent again."""
        if not self._ended:
            return
        pipe = self.redis.pipeline(transaction=False)
        group = self.keys.jobs_group()
        for e in self._ended:
            if e.retry:
                self.scripts.fail(
                    keys=[self.keys.job(e.job_id), self.keys.jobs_counters()], args=[e.error], client=pipe
                )
            elif e.result is None:
                args = [e.entry_id, group, "", b"", 1, "", 0, e.job_id]
                self.scripts.finish(keys=self._finish_keys(e.job_id), args=args, client=pipe)
            else:
                args = [e.entry_id, group, e.result.status.value, pack(e.result), e.ttl_s, e.error,
                        e.result.finished_at, e.job_id]  # fmt: skip
                self.scripts.finish(keys=self._finish_keys(e.job_id), args=args, client=pipe)
        pipe.execute()
        self._ended.clear()

    def _finish_keys(self, job_id: str) -> list[str]:
        return [
            self.keys.job(job_id),
            self.keys.job_result(job_id),
            self.keys.jobs(),
            self.keys.jobs_counters(),
            self.keys.jobs_dead_letter(),
            self.keys.jobs_done_at(int(time.time())),
        ]
