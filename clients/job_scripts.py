"""The job queue's state changes, each one Lua script so that it is atomic.

Per job: a hash (Keys.job) with `status`, `deliveries`, `job` (the packed Job),
`error`, `cancel`; a result key (Keys.job_result); and one entry in the jobs
stream that a consumer group hands out. A status is terminal once it is done,
cancelled, expired or dead; every script that ends a job checks the status
first, so a job ended twice (two consumers, or a cancel racing a finish) keeps
its first result. A result is always written before its stream entry is
acknowledged, in the same script.
"""

from __future__ import annotations

from typing import Any

import redis

from protocol import Keys

# KEYS: job hash, stream, counters. ARGV: job id, packed Job, now.
# Returns 1 if queued, 0 if a job with this id exists already (idempotent submit).
SUBMIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'job', ARGV[2], 'deliveries', 0, 'submitted_at', ARGV[3])
redis.call('XADD', KEYS[2], '*', 'job_id', ARGV[1])
redis.call('HINCRBY', KEYS[3], 'submitted', 1)
return 1
"""

# KEYS: job hash. ARGV: consumer name, now.
# A delivery: counts it and marks the job running, or says why it must not run.
# Returns {'start', deliveries, packed Job, cancel flag, last error} or {status}.
START = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {'missing'} end
if st ~= 'queued' and st ~= 'running' then return {st} end
local n = redis.call('HINCRBY', KEYS[1], 'deliveries', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'consumer', ARGV[1], 'started_at', ARGV[2])
local f = redis.call('HMGET', KEYS[1], 'job', 'cancel', 'error')
return {'start', n, f[1], f[2] or '', f[3] or ''}
"""

# KEYS: job hash, result, stream, counters, dead-letter stream, done-this-second.
# ARGV: stream entry id ('' if none), group, status, packed JobResult, ttl s,
# error, now, job id.
# Ends a live job (result, status, counters, dead letter), then acknowledges the
# entry whatever the job's state. Returns 1 if this call ended it, else 0.
FINISH = """
local st = redis.call('HGET', KEYS[1], 'status')
local live = st == 'queued' or st == 'running'
if live then
  redis.call('SET', KEYS[2], ARGV[4], 'EX', ARGV[5])
  redis.call('HSET', KEYS[1], 'status', ARGV[3], 'finished_at', ARGV[7])
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[6]) end
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  redis.call('HINCRBY', KEYS[4], ARGV[3], 1)
  if ARGV[3] == 'dead' then
    local f = redis.call('HMGET', KEYS[1], 'deliveries', 'job')
    redis.call('XADD', KEYS[5], '*', 'job_id', ARGV[8], 'error', ARGV[6], 'deliveries', f[1], 'job', f[2])
  elseif ARGV[3] == 'done' then
    redis.call('INCR', KEYS[6])
    redis.call('EXPIRE', KEYS[6], 120)
  end
end
if ARGV[1] ~= '' then
  redis.call('XACK', KEYS[3], ARGV[2], ARGV[1])
  redis.call('XDEL', KEYS[3], ARGV[1])
end
if live then return 1 end
return 0
"""

# KEYS: job hash, counters. ARGV: error.
# A failed delivery of a running job: back to queued with its error; the stream
# entry stays pending, so XAUTOCLAIM delivers it again after the idle timeout.
FAIL = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'error', ARGV[1])
redis.call('HINCRBY', KEYS[2], 'failures', 1)
return 1
"""

# KEYS: job hash, cancel flag, result, counters. ARGV: packed cancelled JobResult,
# ttl s, now, cancel flag ttl s.
# A queued job ends cancelled here; a running one gets the request's cancel flag
# (its worker stops it, and its consumer records it cancelled). Returns the
# status after the call, or 'missing'.
CANCEL = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 'missing' end
if st ~= 'queued' and st ~= 'running' then return st end
redis.call('HSET', KEYS[1], 'cancel', '1')
if st == 'running' then
  redis.call('SET', KEYS[2], '1', 'EX', ARGV[4])
  return st
end
redis.call('SET', KEYS[3], ARGV[1], 'EX', ARGV[2])
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('HINCRBY', KEYS[4], 'cancelled', 1)
return 'cancelled'
"""


class Scripts:
    """The scripts registered on one Redis client (EVALSHA, reloaded after a restart)."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.keys = keys
        self.submit: Any = r.register_script(SUBMIT)
        self.start: Any = r.register_script(START)
        self.finish: Any = r.register_script(FINISH)
        self.fail: Any = r.register_script(FAIL)
        self.cancel: Any = r.register_script(CANCEL)


def ensure_group(r: redis.Redis, keys: Keys) -> None:
    """The jobs stream and its consumer group, reading from the start (so jobs
    submitted before the group existed are delivered)."""
    try:
        r.xgroup_create(keys.jobs(), keys.jobs_group(), id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
