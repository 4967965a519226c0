"""The job queue end to end: real Redis, real workers, gateways and consumers
(`tokenwire jobs consume` processes), DESIGN.md §5 promise 6.

Workers run the tiny random Llama checkpoint. The throughput tests use the echo
backend (transport test: no model compute), so 1,000 jobs take seconds on two
cores; the cancel test runs the numpy backend on the long-context copy so a job
runs for seconds. Every test has its own Redis server, with AOF (appendfsync
always) where it restarts it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clients.jobs import JobQueue, JobStatus
from tests.procs import HEARTBEAT_S, MISSED, Proc, Stack

IDLE_S = 2.0  # consumers take over jobs idle this long; > the gateway's client timeout (HEARTBEAT_S * MISSED)
MAX_DELIVERIES = 3
# Token-id prompts: the echo backend repeats the last one, which is not the end id.
SHORT: dict[str, Any] = {"max_tokens": 8, "min_tokens": 8}


class Consumer(Proc):
    def __init__(self, name: str, gateway: str, redis_url: str, log_dir: Path, *extra: str) -> None:
        args = [
            "jobs", "consume", "--gateway", gateway, "--redis", redis_url, "--name", name,
            "--idle-timeout", str(IDLE_S), "--max-deliveries", str(MAX_DELIVERIES),
            "--heartbeat-interval", str(HEARTBEAT_S), "--missed-heartbeats", str(MISSED), *extra,
        ]  # fmt: skip
        self.consumer_name = name
        self.gateway = gateway
        self.redis_url = redis_url
        self.extra = extra
        super().__init__(f"{name}-{time.monotonic_ns()}", "clients.cli", args, log_dir)

    def restarted(self) -> Consumer:
        """A new process under the same consumer name (as systemd would restart it)."""
        return Consumer(self.consumer_name, self.gateway, self.redis_url, self.log_path.parent, *self.extra)


class JobStack(Stack):
    def __init__(self, model: Path, redis_url: str, log_dir: Path) -> None:
        super().__init__(model, redis_url, log_dir)
        self.consumers: list[Consumer] = []
        self.queue = JobQueue(redis_url)

    def consumer(self, *extra: str) -> Consumer:
        gateway = self.gateways[len(self.consumers) % len(self.gateways)]
        c = Consumer(f"consumer{len(self.consumers)}", gateway.endpoint, self.redis_url, self.log_dir, *extra)
        self.consumers.append(c)
        return c

    def wait_capacity(self, timeout: float = 30.0) -> None:
        """Until every worker has a heartbeat with its load in Redis (consumers take
        jobs only when they see free slots)."""
        deadline = time.monotonic() + timeout
        while any(self.redis.get(self.keys.heartbeat(w.worker_id)) is None for w in self.workers):
            assert time.monotonic() < deadline, "workers have no heartbeat in Redis"
            time.sleep(0.05)

    def counters(self) -> dict[str, int]:
        raw: dict[Any, Any] = self.redis.hgetall(self.keys.jobs_counters())
        return {k.decode(): int(v) for k, v in raw.items()}

    def pending(self) -> int:
        info: Any = self.redis.xpending(self.keys.jobs(), self.keys.jobs_group())
        return int(info["pending"])

    def close(self) -> None:
        for c in self.consumers:
            c.stop()
        self.queue.close()
        super().close()


def _stack(model: Path, redis_url: str, log_dir: Path, workers: int, gateways: int, *worker_args: str) -> JobStack:
    s = JobStack(model, redis_url, log_dir)
    try:
        for _ in range(workers):
            s.worker(*worker_args)
        for _ in range(gateways):
            s.gateway()
        for g in s.gateways:
            g.wait_workers(workers)
        s.wait_capacity()
    except BaseException:
        s.close()
        raise
    return s


@pytest.fixture
def echo_stack(service_model: Path, redis_server_factory: Any, tmp_path: Path) -> Iterator[JobStack]:
    """2 echo workers, 1 gateway, a Redis with AOF; consumers are up to the test."""
    server = redis_server_factory(appendonly=True)
    s = _stack(service_model, server.url, tmp_path, 2, 1, "--backend", "echo")
    s.redis_server = server  # type: ignore[attr-defined]
    yield s
    s.close()


def _prompt(i: int) -> list[int]:
    return [5 + i % 50, 7, 11 + i % 97]


def _jobs(n: int, tokens: int) -> list[dict[str, Any]]:
    return [{"prompt": _prompt(i), "max_tokens": tokens, "min_tokens": tokens} for i in range(n)]


def _assert_each_done_once(s: JobStack, ids: list[str], tokens: int) -> list[Any]:
    results = list(s.queue.results(ids, timeout=90))
    assert sorted(r.job_id for r in results) == sorted(ids)
    not_done = [(r.job_id, r.status, r.deliveries, r.error) for r in results if r.status != JobStatus.DONE]
    assert not not_done, f"{len(not_done)} not done, e.g. {not_done[:3]}"
    assert all(len(r.outputs[0].token_ids) == tokens for r in results)
    # The counter moves only in the script call that ends a job: a job completed
    # twice would count twice.
    assert s.counters().get("done") == len(ids)
    assert sum(1 for _ in s.redis.scan_iter(match=s.keys.job_result("*"), count=1000)) == len(ids)
    deadline = time.monotonic() + 10
    while s.pending() or s.redis.xlen(s.keys.jobs()):
        assert time.monotonic() < deadline, f"{s.pending()} jobs still pending after every job ended"
        time.sleep(0.1)
    return results


@pytest.mark.slow
def test_1000_jobs_while_a_consumer_is_killed_every_few_seconds(echo_stack: JobStack):
    s = echo_stack
    # A job may be in flight at several of the victim's lives in a row: allow it
    # more deliveries than the other tests do (dead letters are tested below).
    steady = s.consumer("--max-in-flight", "16", "--max-deliveries", "20")
    victim = s.consumer("--max-in-flight", "16", "--max-deliveries", "20")
    # 300 echo tokens a job: about 10 s for 1,000 on two busy cores. The victim is
    # killed every 2 s, or sooner on a fast machine: whenever another 150 jobs are done.
    ids = s.queue.submit_many(_jobs(1000, 300))
    kills, last_kill, next_mark = 0, time.monotonic(), 150
    deadline = time.monotonic() + 90
    while (done := s.counters().get("done", 0)) + s.counters().get("dead", 0) < len(ids):
        assert time.monotonic() < deadline, f"after 90 s: {s.counters()}, {s.pending()} pending"
        since = time.monotonic() - last_kill
        if since > 2.0 or (done >= next_mark and since > 0.5):
            victim.kill9()
            kills += 1
            victim = victim.restarted()
            s.consumers.append(victim)
            last_kill, next_mark = time.monotonic(), done + 150
        time.sleep(0.05)
    results = _assert_each_done_once(s, ids, 300)
    assert kills >= 3, f"the run ended after {kills} kills: make the jobs longer"
    assert any(r.deliveries > 1 for r in results), "no job was ever taken over from a killed consumer"
    assert steady.alive


def test_always_failing_job_is_dead_lettered_with_its_error(echo_stack: JobStack):
    s = echo_stack
    s.consumer()
    good = s.queue.submit(_prompt(1), **SHORT)
    bad = s.queue.submit([10**6], job_id="bad-token", **SHORT)  # beyond the vocabulary: refused each time
    result = s.queue.result(bad, timeout=IDLE_S * MAX_DELIVERIES + 20)
    assert result.status == JobStatus.DEAD
    assert result.deliveries == MAX_DELIVERIES
    assert result.error and "vocab" in result.error.lower(), result.error
    assert s.queue.status(bad) == JobStatus.DEAD
    assert s.counters().get("failures") == MAX_DELIVERIES - 1
    dead = s.queue.dead_letters()
    assert [d["job_id"] for d in dead] == ["bad-token"]
    assert dead[0]["deliveries"] == str(MAX_DELIVERIES) and dead[0]["error"] == result.error
    assert s.queue.result(good, timeout=10).status == JobStatus.DONE
    assert s.pending() == 0


def test_same_job_id_twice_runs_once(echo_stack: JobStack):
    s = echo_stack
    s.consumer()
    first = s.queue.submit(_prompt(2), job_id="once", **SHORT)
    again = s.queue.submit(_prompt(3), job_id="once", max_tokens=2)  # same id, other request: ignored
    assert first == again == "once"
    result = s.queue.result("once", timeout=20)
    assert result.status == JobStatus.DONE and result.deliveries == 1
    assert result.outputs[0].token_ids == [_prompt(2)[-1]] * SHORT["max_tokens"]
    # Submitted again after it ended: still the one job and its one result.
    s.queue.submit(_prompt(2), job_id="once", **SHORT)
    time.sleep(1.0)
    assert s.queue.result("once", timeout=1) == result
    assert s.counters() == {"submitted": 1, "done": 1}
    assert s.pending() == 0


def test_redis_restart_mid_run_loses_nothing(echo_stack: JobStack):
    """Redis runs with AOF, appendfsync always, and is killed with SIGKILL mid-run."""
    s = echo_stack
    s.consumer()
    s.consumer()
    ids = s.queue.submit_many(_jobs(600, 200))
    deadline = time.monotonic() + 30
    while s.counters().get("done", 0) < 50:
        assert time.monotonic() < deadline, "no jobs finished before the restart"
        time.sleep(0.05)
    s.redis_server.kill()  # type: ignore[attr-defined]
    time.sleep(1.5)
    s.redis_server.start()  # type: ignore[attr-defined]
    assert 0 < s.counters().get("done", 0) < len(ids), "the restart did not land mid-run"
    late = s.queue.submit_many(_jobs(20, 200))
    _assert_each_done_once(s, ids + late, 200)


def test_cancel_queued_and_running_jobs_and_deadlines(long_model: Path, redis_server_factory: Any, tmp_path: Path):
    """One numpy worker with one batch slot, so a long job keeps the others queued."""
    long: dict[str, Any] = {"max_tokens": 6000, "min_tokens": 6000, "temperature": 0.0}
    s = _stack(long_model, redis_server_factory().url, tmp_path, 1, 1, "--max-batch-size", "1")
    try:
        s.consumer()
        running = s.queue.submit([5, 6, 7, 8], **long)
        deadline = time.monotonic() + 20
        while s.queue.status(running) != JobStatus.RUNNING or s.load(s.workers[0]).num_active_requests != 1:
            assert time.monotonic() < deadline, f"job not running: {s.queue.info(running)}"
            time.sleep(0.05)
        # The consumer reads the workers' load every 0.25 s: let it see the busy slot first.
        time.sleep(0.5)
        queued = s.queue.submit(_prompt(1), **SHORT)
        expiring = s.queue.submit(_prompt(2), deadline_s=1.0, **SHORT)
        time.sleep(0.5)
        assert s.queue.status(queued) == s.queue.status(expiring) == JobStatus.QUEUED

        assert s.queue.cancel(queued) == JobStatus.CANCELLED
        result = s.queue.result(queued, timeout=1)
        assert result.status == JobStatus.CANCELLED and result.deliveries == 0 and not result.outputs

        time.sleep(0.7)  # past the deadline of `expiring`, still queued
        assert s.queue.cancel(running) == JobStatus.RUNNING  # the worker stops it at its next poll
        result = s.queue.result(running, timeout=20)
        assert result.status == JobStatus.CANCELLED and result.deliveries == 1
        assert 0 < len(result.outputs[0].token_ids) < long["max_tokens"]
        assert result.outputs[0].finish_reason == "cancelled"

        result = s.queue.result(expiring, timeout=10)
        assert result.status == JobStatus.EXPIRED and not result.outputs
        assert result.error == "deadline passed before the job ran"

        overrun = s.queue.submit([9, 10, 11], deadline_s=1.5, **long)
        result = s.queue.result(overrun, timeout=20)
        assert result.status == JobStatus.EXPIRED and result.error == "deadline passed while the job ran"
        assert 0 < len(result.outputs[0].token_ids) < long["max_tokens"]
        assert s.queue.cancel(overrun) == JobStatus.EXPIRED  # ended: cancel changes nothing

        s.wait_idle(s.workers[0])
        deadline = time.monotonic() + 10
        while s.pending() or s.redis.xlen(s.keys.jobs()):
            assert time.monotonic() < deadline, "the cancelled job's entry was never acknowledged"
            time.sleep(0.1)
        assert s.counters() == {"submitted": 4, "cancelled": 2, "expired": 2}
    finally:
        s.close()


def test_jobs_run_cli_writes_every_result(echo_stack: JobStack, tmp_path: Path):
    s = echo_stack
    s.consumer()
    prompts = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": _prompt(i), "job_id": f"line-{i}", **SHORT}) for i in range(200)]
    prompts.write_text("\n".join([*lines, lines[0]]) + "\n")  # the last line repeats the first job
    out = tmp_path / "results.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "clients.cli", "jobs", "run", str(prompts), "--out", str(out),
         "--redis", s.redis_url, "--timeout", "60"],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "200/200" in done.stderr and "200 done" in done.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["job_id"] for r in results) == sorted(f"line-{i}" for i in range(200))
    assert all(r["status"] == "done" and len(r["outputs"][0]["token_ids"]) == SHORT["max_tokens"] for r in results)
    stats = subprocess.run(
        [sys.executable, "-m", "clients.cli", "jobs", "stats", "--redis", s.redis_url],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    # queued, in flight, submitted, done, failed deliveries, cancelled, expired, dead-lettered, consumers, done/s
    row = stats.stdout.splitlines()[2].split()
    assert row[:9] == ["0", "0", "200", "200", "0", "0", "0", "0", "1"], stats.stdout
    assert float(row[9]) > 0
