"""The job queue client: durable batch generation through Redis.

    queue = JobQueue("redis://127.0.0.1:6379/0")
    job_id = queue.submit("Summarize: ...", max_tokens=64, job_id="doc-17", deadline_s=3600)
    print(queue.result(job_id, timeout=600).outputs[0].text)
    ids = queue.submit_many([{"prompt": p, "max_tokens": 32} for p in prompts])
    for result in queue.results(ids):
        ...

A job is one generation request (a prompt, a model and SamplingParams, as for
`Client`) plus a job id and an optional deadline. `submit` appends it to a
Redis Stream; consumers (`tokenwire jobs consume`, clients/jobs_consumer.py) run
it on the service and store its JobResult with a TTL. Submitting an id that
exists already does nothing and returns that id, so retrying a submit is safe;
the id stays taken until the job's result expires. Depends on redis and
pydantic, not on ZeroMQ.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError

import protocol
from clients.job_scripts import Scripts, ensure_group
from clients.params import SamplingParams, sampling_params
from clients.wire import Prompt, to_submit
from protocol import CANCEL_TTL_S, DEFAULT_PREFIX, Keys, describe_invalid
from protocol.jobs import DEFAULT_RESULT_TTL_S, Job, JobResult, JobStatus, pack, unpack_job, unpack_result

__all__ = ["JobQueue", "JobResult", "JobSpecError", "JobStatus", "QueueStats"]

# Results are polled: every _POLL_S[0] s while few are awaited, _POLL_S[1] while many
# (each poll reads them all), growing to _POLL_S[2] while none arrive.
_POLL_S = (0.005, 0.05, 0.5)
_FEW = 16
_SUBMIT_CHUNK = 500
_THROUGHPUT_WINDOW_S = 10


class JobSpecError(ValueError):
    """A job submit_many refused, before anything was queued: `index` is its place in
    the batch; the message names the field and the problem, in one line."""

    def __init__(self, index: int, problem: str) -> None:
        super().__init__(problem)
        self.index = index


@dataclass(frozen=True, slots=True)
class QueueStats:
    queued: int  # in the stream, not yet handed to a consumer
    in_flight: int  # handed to a consumer and not acknowledged (running, or waiting for a retry)
    submitted: int
    done: int
    failures: int  # failed deliveries, each retried or dead-lettered
    cancelled: int
    expired: int
    dead: int  # in the dead-letter stream
    consumers: int
    done_per_s: float  # over the last _THROUGHPUT_WINDOW_S seconds, this one included


class JobQueue:
    def __init__(
        self,
        redis_url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = DEFAULT_PREFIX,
        socket_timeout_s: float = 10.0,
    ) -> None:
        self.keys = Keys(prefix)
        self.redis: Any = redis.Redis.from_url(redis_url, socket_timeout=socket_timeout_s)
        self._scripts = Scripts(self.redis, self.keys)
        self._group_ready = False

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> JobQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submitting ------------------------------------------------------------------------

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        /,
        *,
        job_id: str | None = None,
        model: str | None = None,
        deadline_s: float | None = None,
        result_ttl_s: int = DEFAULT_RESULT_TTL_S,
        **options: Any,
    ) -> str:
        """Queue one job and return its id. `deadline_s`: seconds from now after
        which the job ends EXPIRED instead of running (or is stopped); `options`:
        SamplingParams fields (max_tokens, temperature, priority, stop, ...), over
        `params`; for a chat (`messages` instead of a prompt) `tools`, `tool_choice` and
        `parallel_tool_calls` as in Client.chat; `embedding` ({} or {"pooling": ...}): the
        prompt's embedding instead of text. Bad arguments raise before anything is queued."""
        return self.submit_many([{"prompt": prompt, "params": params, "job_id": job_id, "model": model,
                                  "deadline_s": deadline_s, "result_ttl_s": result_ttl_s, **options}])[0]  # fmt: skip

    def submit_many(self, jobs: Iterable[Mapping[str, Any]]) -> list[str]:
        """Queue many jobs, pipelined; each mapping holds submit's arguments by name
        (`prompt` required, `params` a SamplingParams). Returns the ids in order.
        All are validated first: JobSpecError names the first bad one's place."""
        records = []
        for index, spec in enumerate(jobs):
            try:
                records.append(self._job(dict(spec)))
            except ValidationError as e:  # pydantic's report is several lines, with URLs
                raise JobSpecError(index, describe_invalid("job", e)) from None
            except ValueError as e:
                raise JobSpecError(index, str(e)) from None
        self._ensure_group()
        now = str(time.time())
        for i in range(0, len(records), _SUBMIT_CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            for job in records[i : i + _SUBMIT_CHUNK]:
                self._scripts.submit(
                    keys=[self.keys.job(job.job_id), self.keys.jobs(), self.keys.jobs_counters()],
                    args=[job.job_id, pack(job), now],
                    client=pipe,
                )
            pipe.execute()
        return [job.job_id for job in records]

    def _job(self, spec: dict[str, Any]) -> Job:
        if ("prompt" in spec) == ("messages" in spec):
            raise ValueError(f"a job needs a 'prompt' (text or token ids) or chat 'messages'; got keys {sorted(spec)}")
        prompt = spec.pop("prompt", None)
        messages = spec.pop("messages", None)  # the gateway applies the model's chat template
        job_id = spec.pop("job_id", None) or uuid.uuid4().hex
        deadline_s = spec.pop("deadline_s", None)
        ttl = spec.pop("result_ttl_s", DEFAULT_RESULT_TTL_S)
        model = spec.pop("model", None)
        params = spec.pop("params", None)
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0 seconds from now, got {deadline_s}")
        spec.pop("streaming", None)  # a job's result is stored whole
        tools = {k: spec.pop(k) for k in ("tools", "tool_choice", "parallel_tool_calls") if k in spec}
        embedding = spec.pop("embedding", None)
        now = time.time()
        submit = to_submit(prompt, sampling_params(params, spec), request_id=job_id, model=model, messages=messages,
                           **tools)  # fmt: skip
        if embedding is not None:  # the prompt's embedding (protocol.EmbeddingConfig's fields), nothing generated
            config = protocol.EmbeddingConfig.model_validate(embedding)
            submit = submit.model_copy(update={"embedding_config": config})
        return Job(
            submit=submit,
            deadline=None if deadline_s is None else now + deadline_s,
            submitted_at=now,
            result_ttl_s=ttl,
        )

    def _ensure_group(self) -> None:
        if not self._group_ready:
            ensure_group(self.redis, self.keys)
            self._group_ready = True

    # -- following jobs ------------------------------------------------------------------------

    def status(self, job_id: str) -> JobStatus | None:
        """None if no such job (never submitted, or its result expired)."""
        raw = self.redis.hget(self.keys.job(job_id), "status")
        return None if raw is None else JobStatus(raw.decode())

    def info(self, job_id: str) -> dict[str, str]:
        """The job's state hash (status, deliveries, error, consumer, times), without the job itself."""
        raw = self.redis.hgetall(self.keys.job(job_id))
        return {k.decode(): v.decode(errors="replace") for k, v in raw.items() if k != b"job"}

    def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Wait for the job to end; TimeoutError after `timeout` seconds (None: no limit)."""
        for result in self.results([job_id], timeout):
            return result
        raise AssertionError("unreachable: results yields or raises")

    def results(self, job_ids: Sequence[str], timeout: float | None = None) -> Iterator[JobResult]:
        """Yield each job's result as it ends, in the order they end. Raises
        TimeoutError naming how many are missing after `timeout` seconds; a
        Redis outage meanwhile is waited out (within the timeout)."""
        waiting = list(dict.fromkeys(job_ids))
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.0
        while waiting:
            try:
                blobs = self._get_results(waiting)
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                blobs = [None] * len(waiting)
            still = []
            for job_id, blob in zip(waiting, blobs, strict=True):
                if blob is None:
                    still.append(job_id)
                else:
                    yield unpack_result(blob)
            if len(still) < len(waiting):
                pause = 0.0
            waiting = still
            if not waiting:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{len(waiting)} of {len(job_ids)} jobs not finished after {timeout} s")
            floor = _POLL_S[0] if len(waiting) <= _FEW else _POLL_S[1]
            pause = min(_POLL_S[2], max(floor, pause * 1.5))
            time.sleep(pause)

    def _get_results(self, job_ids: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for i in range(0, len(job_ids), _SUBMIT_CHUNK):
            out.extend(self.redis.mget([self.keys.job_result(j) for j in job_ids[i : i + _SUBMIT_CHUNK]]))
        return out

    def cancel(self, job_id: str) -> JobStatus | None:
        """A queued job ends CANCELLED now; a running one gets its request's
        cancel flag, its worker stops it and it ends CANCELLED (with what it had
        produced). Returns the status after the call (None: no such job)."""
        now = time.time()
        ttl = self._ttl_of(job_id)
        result = JobResult(job_id=job_id, status=JobStatus.CANCELLED, finished_at=now)
        status = self._scripts.cancel(
            keys=[self.keys.job(job_id), self.keys.cancel(job_id), self.keys.job_result(job_id),
                  self.keys.jobs_counters()],
            args=[pack(result), ttl, now, CANCEL_TTL_S],
        )  # fmt: skip
        return None if status == b"missing" else JobStatus(status.decode())

    def _ttl_of(self, job_id: str) -> int:
        blob = self.redis.hget(self.keys.job(job_id), "job")
        return unpack_job(blob).result_ttl_s if blob is not None else DEFAULT_RESULT_TTL_S

    # -- the queue as a whole ---------------------------------------------------------------------

    def stats(self) -> QueueStats:
        self._ensure_group()
        now = int(time.time())
        pipe = self.redis.pipeline(transaction=False)
        pipe.xinfo_groups(self.keys.jobs())
        pipe.xlen(self.keys.jobs())
        pipe.hgetall(self.keys.jobs_counters())
        pipe.mget([self.keys.jobs_done_at(s) for s in range(now - _THROUGHPUT_WINDOW_S + 1, now + 1)])
        groups, length, counters, done_at = pipe.execute()
        group = next((g for g in groups if g["name"].decode() == self.keys.jobs_group()), None)
        c = {k.decode(): int(v) for k, v in counters.items()}
        pending = int(group["pending"]) if group else 0
        # Redis cannot tell the lag after XDELs; acknowledged entries are deleted,
        # so the stream holds exactly the unread and the pending ones.
        lag = group.get("lag") if group else length
        return QueueStats(
            queued=int(lag) if lag is not None else max(0, length - pending),
            in_flight=pending,
            submitted=c.get("submitted", 0),
            done=c.get("done", 0),
            failures=c.get("failures", 0),
            cancelled=c.get("cancelled", 0),
            expired=c.get("expired", 0),
            dead=c.get("dead", 0),
            consumers=int(group["consumers"]) if group else 0,
            done_per_s=sum(int(n) for n in done_at if n is not None) / _THROUGHPUT_WINDOW_S,
        )

    def requeue_dead(self, count: int | None = None) -> list[str]:
        """Queue dead-lettered jobs again (the oldest first, `count` of them or all),
        fresh: no deliveries, no result. Returns their ids."""
        entries = self.redis.xrange(self.keys.jobs_dead_letter(), count=count)
        self._ensure_group()
        now = str(time.time())
        ids = []
        for entry_id, f in entries:
            job_id = f[b"job_id"].decode()
            self.redis.delete(self.keys.job(job_id), self.keys.job_result(job_id))
            self._scripts.submit(keys=[self.keys.job(job_id), self.keys.jobs(), self.keys.jobs_counters()],
                                 args=[job_id, f[b"job"], now])  # fmt: skip
            self.redis.xdel(self.keys.jobs_dead_letter(), entry_id)
            ids.append(job_id)
        return ids

    def purge_dead(self) -> int:
        """Drop every dead letter; how many there were."""
        n = int(self.redis.xlen(self.keys.jobs_dead_letter()))
        self.redis.delete(self.keys.jobs_dead_letter())
        return n

    def dead_letters(self, count: int = 100) -> list[dict[str, str]]:
        """The most recent dead-lettered jobs: job_id, error, deliveries (newest first)."""
        entries = self.redis.xrevrange(self.keys.jobs_dead_letter(), count=count)
        return [{k.decode(): v.decode(errors="replace") for k, v in f.items() if k != b"job"} for _, f in entries]
