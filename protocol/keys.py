"""Every Redis key tokenwire uses, under one configurable prefix.

Ids are used verbatim: keys are only ever built, never parsed back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_PREFIX = "tokenwire"
# A cancel flag only has to outlive the request it stops.
CANCEL_TTL_S = 3600
# A rate window's counter is read during its minute and the next (the sliding estimate).
RATE_WINDOW_TTL_S = 120
# A stored response (the Responses API's `store`) is kept this long for a follow-up to continue.
RESPONSE_TTL_S = 30 * 24 * 3600

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.\-]+(:[A-Za-z0-9_.\-]+)*")


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not _PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(f"Redis key prefix {self.prefix!r} must be words of [A-Za-z0-9_.-] joined by ':'")

    def cancel(self, request_id: str) -> str:
        """String flag; set (with CANCEL_TTL_S) by anyone to cancel the request."""
        return f"{self.prefix}:cancel:{request_id}"

    def response(self, response_id: str) -> str:
        """String: a stored Responses API response and the conversation it ends (JSON), with RESPONSE_TTL_S."""
        return f"{self.prefix}:response:{response_id}"

    def workers(self) -> str:
        """Sorted set: worker id scored by the time of its last heartbeat."""
        return f"{self.prefix}:workers"

    def worker(self, worker_id: str) -> str:
        """A worker's encoded WorkerInfo, with a TTL its heartbeat refreshes."""
        return f"{self.prefix}:worker:{worker_id}"

    def heartbeat(self, worker_id: str) -> str:
        """A worker's latest encoded Heartbeat (with its load), with a TTL."""
        return f"{self.prefix}:heartbeat:{worker_id}"

    def iteration_stats(self, worker_id: str) -> str:
        """Stream of a worker's encoded IterationStats, capped in length."""
        return f"{self.prefix}:stats:iterations:{worker_id}"

    def request_stats(self, request_id: str) -> str:
        """Hash of one request's latest stats, with a TTL."""
        return f"{self.prefix}:stats:request:{request_id}"

    def jobs(self) -> str:
        """Stream of queued jobs, read through a consumer group."""
        return f"{self.prefix}:jobs"

    def jobs_group(self) -> str:
        """The consumer group (a name inside the jobs stream, not a key)."""
        return "consumers"

    def jobs_dead_letter(self) -> str:
        """Stream of jobs that failed too often."""
        return f"{self.prefix}:jobs:dead"

    def job(self, job_id: str) -> str:
        """Hash of one job's state: status, deliveries, last error, the packed Job.
        No TTL while the job is live; the result's TTL once it has ended."""
        return f"{self.prefix}:job:{job_id}"

    def job_result(self, job_id: str) -> str:
        """A job's packed JobResult, written once (a job completed twice keeps the
        first), with a TTL."""
        return f"{self.prefix}:job:{job_id}:result"

    def jobs_counters(self) -> str:
        """Hash of totals: submitted, done, cancelled, expired, dead, failures."""
        return f"{self.prefix}:jobs:counters"

    def jobs_done_at(self, unix_second: int) -> str:
        """Count of jobs that ended done in that second, with a short TTL (throughput)."""
        return f"{self.prefix}:jobs:done:{unix_second}"

    def api_keys(self) -> str:
        """Hash: SHA-256 (hex) of an API key -> its encoded ApiKeyRecord. No TTL; a key
        revoked is a field deleted, and every gateway drops it at its next refresh."""
        return f"{self.prefix}:api_keys"

    def api_key_usage(self, name: str) -> str:
        """Hash of an API key's totals (by its name): requests, prompt_tokens,
        completion_tokens. No TTL."""
        return f"{self.prefix}:api_key:{name}:usage"

    def api_key_in_flight(self, name: str) -> str:
        """Sorted set of an API key's requests in flight on any gateway, each scored by
        the unix time its lease ends (a gateway that died leaves nothing for longer)."""
        return f"{self.prefix}:api_key:{name}:in_flight"

    def api_key_requests(self, name: str, unix_minute: int) -> str:
        """Count of an API key's requests started in that minute, with RATE_WINDOW_TTL_S."""
        return f"{self.prefix}:api_key:{name}:requests:{unix_minute}"

    def api_key_tokens(self, name: str, unix_minute: int) -> str:
        """Count of an API key's tokens (prompt and output) in that minute, with RATE_WINDOW_TTL_S."""
        return f"{self.prefix}:api_key:{name}:tokens:{unix_minute}"
