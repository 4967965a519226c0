"""The job queue's client side and its Redis scripts, against a real Redis (no
consumers or workers here: tests/integration/test_jobs.py runs those)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis

from clients.cli import main as cli
from clients.job_scripts import Scripts, ensure_group
from clients.jobs import JobQueue, JobSpecError, JobStatus
from clients.params import SamplingParams
from clients.wire import to_submit
from protocol.jobs import JobOutput, JobResult, pack, unpack_job


@pytest.fixture
def queue(redis_url: str) -> Iterator[JobQueue]:
    with JobQueue(redis_url) as q:
        yield q


def _entries(q: JobQueue) -> list[tuple[str, str]]:
    return [(e.decode(), f[b"job_id"].decode()) for e, f in q.redis.xrange(q.keys.jobs())]


def _counters(q: JobQueue) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in q.redis.hgetall(q.keys.jobs_counters()).items()}


def test_submit_queues_the_request_under_the_job_id(queue: JobQueue):
    before = time.time()
    job_id = queue.submit("Hello", max_tokens=7, temperature=0.0, priority=0.9, deadline_s=60)
    assert queue.status(job_id) == JobStatus.QUEUED
    assert [j for _, j in _entries(queue)] == [job_id]
    job = unpack_job(queue.redis.hget(queue.keys.job(job_id), "job"))
    assert job.submit.request_id == job_id  # the job's cancel flag is its request's
    assert (job.submit.prompt, job.submit.max_tokens, job.submit.priority) == ("Hello", 7, 0.9)
    assert job.deadline is not None and before + 60 <= job.deadline <= time.time() + 60
    assert queue.info(job_id)["deliveries"] == "0"


def test_a_job_takes_sampling_params_and_options_over_them(queue: JobQueue):
    params = SamplingParams(max_tokens=7, presence_penalty=0.5, guided_regex="[ab]+", stop=["!"])
    job_id = queue.submit([5, 6], params, model="m", temperature=0.0)
    submit = unpack_job(queue.redis.hget(queue.keys.job(job_id), "job")).submit
    expected = to_submit([5, 6], replace(params, temperature=0.0), request_id=job_id, model="m")
    assert submit == expected


def test_same_job_id_is_queued_once(queue: JobQueue):
    assert queue.submit("first", job_id="j-1", max_tokens=3) == "j-1"
    assert queue.submit_many([{"prompt": "second", "job_id": "j-1"}, {"prompt": "other", "job_id": "j-2"}]) == [
        "j-1",
        "j-2",
    ]
    assert [j for _, j in _entries(queue)] == ["j-1", "j-2"]
    assert unpack_job(queue.redis.hget(queue.keys.job("j-1"), "job")).submit.prompt == "first"
    assert _counters(queue) == {"submitted": 2}


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -1.0}, "temperature"),
        ({"prompt": "x", "priority": 2.0}, "priority"),
        ({"prompt": [], "max_tokens": 4}, "input_token_ids"),
        ({"prompt": "x", "deadline_s": 0}, "deadline_s"),
        ({"max_tokens": 4}, "prompt"),
    ],
)
def test_a_bad_job_queues_nothing(queue: JobQueue, spec: dict[str, Any], match: str):
    with pytest.raises(JobSpecError, match=match) as refused:
        queue.submit_many([{"prompt": "fine", "max_tokens": 2}, spec])
    assert refused.value.index == 1
    assert queue.redis.exists(queue.keys.jobs()) == 0 or _entries(queue) == []


def test_cancel_a_queued_job(queue: JobQueue):
    job_id = queue.submit("Hello", max_tokens=4)
    assert queue.cancel(job_id) == JobStatus.CANCELLED
    result = queue.result(job_id, timeout=1)
    assert (result.status, result.deliveries, result.outputs) == (JobStatus.CANCELLED, 0, [])
    assert queue.cancel(job_id) == JobStatus.CANCELLED
    assert queue.redis.ttl(queue.keys.job_result(job_id)) > 0
    assert queue.redis.ttl(queue.keys.job(job_id)) > 0
    assert queue.cancel("no-such-job") is None
    assert queue.status("no-such-job") is None
    assert _counters(queue) == {"submitted": 1, "cancelled": 1}


def test_result_waits_then_times_out(queue: JobQueue):
    job_id = queue.submit("Hello", max_tokens=4)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="1 of 1 jobs"):
        queue.result(job_id, timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 2.0


def _deliver(q: JobQueue, scripts: Scripts, consumer: str) -> tuple[str, list[Any]]:
    ensure_group(q.redis, q.keys)
    reply = q.redis.xreadgroup(q.keys.jobs_group(), consumer, {q.keys.jobs(): ">"}, count=1)
    entry = reply[0][1][0][0].decode()
    job_id = reply[0][1][0][1][b"job_id"].decode()
    return entry, scripts.start(keys=[q.keys.job(job_id)], args=[consumer, time.time()])


def _finish(q: JobQueue, scripts: Scripts, entry: str, result: JobResult) -> int:
    k = q.keys
    keys = [k.job(result.job_id), k.job_result(result.job_id), k.jobs(), k.jobs_counters(), k.jobs_dead_letter(),
            k.jobs_done_at(int(time.time()))]  # fmt: skip
    args = [entry, k.jobs_group(), result.status.value, pack(result), 60, result.error or "", result.finished_at,
            result.job_id]  # fmt: skip
    return int(scripts.finish(keys=keys, args=args))


def test_a_job_ended_twice_keeps_its_first_result(queue: JobQueue):
    """Two consumers both finishing a job (one took it over from a slow one)."""
    scripts = Scripts(queue.redis, queue.keys)
    job_id = queue.submit("Hello", max_tokens=4)
    entry, start = _deliver(queue, scripts, "a")
    assert start[0] == b"start" and int(start[1]) == 1
    again = scripts.start(keys=[queue.keys.job(job_id)], args=["b", time.time()])  # taken over: 2nd delivery
    assert int(again[1]) == 2
    first = JobResult(job_id=job_id, status=JobStatus.DONE, outputs=[JobOutput(text="a", token_ids=[1])],
                      deliveries=2, finished_at=time.time())  # fmt: skip
    second = first.model_copy(update={"outputs": [JobOutput(text="b", token_ids=[2])]})
    assert _finish(queue, scripts, entry, first) == 1
    assert _finish(queue, scripts, entry, second) == 0
    assert queue.result(job_id, timeout=1) == first
    assert _counters(queue) == {"submitted": 1, "done": 1}
    assert queue.stats().done_per_s == pytest.approx(0.1)  # one job in the 10 s window
    # Acknowledged and deleted: nothing pending, nothing left in the stream.
    assert queue.redis.xpending(queue.keys.jobs(), queue.keys.jobs_group())["pending"] == 0
    assert queue.redis.xlen(queue.keys.jobs()) == 0
    # A late start of the ended job does not revive it.
    assert scripts.start(keys=[queue.keys.job(job_id)], args=["c", time.time()]) == [b"done"]


def test_a_failed_delivery_stays_pending_and_dead_letters_copy_the_job(queue: JobQueue):
    scripts = Scripts(queue.redis, queue.keys)
    job_id = queue.submit("Hello", max_tokens=4, job_id="poison")
    entry, _ = _deliver(queue, scripts, "a")
    assert scripts.fail(keys=[queue.keys.job(job_id), queue.keys.jobs_counters()], args=["boom"]) == 1
    assert queue.status(job_id) == JobStatus.QUEUED and queue.info(job_id)["error"] == "boom"
    assert queue.redis.xpending(queue.keys.jobs(), queue.keys.jobs_group())["pending"] == 1
    dead = JobResult(job_id=job_id, status=JobStatus.DEAD, error="boom again", deliveries=1, finished_at=time.time())
    assert _finish(queue, scripts, entry, dead) == 1
    [letter] = queue.dead_letters()
    assert letter == {"job_id": "poison", "error": "boom again", "deliveries": "1"}
    stats = queue.stats()
    assert (stats.submitted, stats.failures, stats.dead, stats.in_flight, stats.queued) == (1, 1, 1, 0, 0)


def test_stats_count_queued_and_in_flight(queue: JobQueue):
    scripts = Scripts(queue.redis, queue.keys)
    queue.submit_many([{"prompt": f"p{i}", "max_tokens": 2} for i in range(5)])
    _deliver(queue, scripts, "a")
    _deliver(queue, scripts, "a")
    stats = queue.stats()
    assert (stats.queued, stats.in_flight, stats.submitted, stats.done, stats.consumers) == (3, 2, 5, 0, 1)


def test_cli_submit_status_result_cancel(redis_url: str, capsys: pytest.CaptureFixture[str]):
    assert cli(["jobs", "submit", "Hello there", "--job-id", "cli-1", "--max-tokens", "3", "--redis", redis_url]) == 0
    assert capsys.readouterr().out.strip() == "cli-1"
    assert cli(["jobs", "status", "cli-1", "--redis", redis_url]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "queued"
    assert cli(["jobs", "result", "cli-1", "--redis", redis_url]) == 1
    assert "job cli-1 is queued; no result yet" in capsys.readouterr().err
    assert cli(["jobs", "cancel", "cli-1", "--redis", redis_url]) == 0
    assert capsys.readouterr().out.strip() == "job cli-1: cancelled"
    assert cli(["jobs", "result", "cli-1", "--redis", redis_url]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "cancelled"
    assert cli(["jobs", "status", "nope", "--redis", redis_url]) == 1
    assert "no job 'nope'" in capsys.readouterr().err
    assert cli(["jobs", "submit", "x", "--max-tokens", "0", "--redis", redis_url]) == 1
    err = capsys.readouterr().err
    assert err == "error: invalid job: max_tokens: Input should be greater than or equal to 1 (got 0)\n"


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("not json", "prompts.jsonl:2: not JSON"),
        ('{"max_tokens": 3}', 'prompts.jsonl:2: each line needs a "prompt" or chat "messages"'),
        ('{"custom_id": "a", "body": {"max_tokens": 3}}', 'prompts.jsonl:2: each line needs a "prompt"'),
        ('{"custom_id": "a", "body": {"messages": [], "colour": 1}}', "prompts.jsonl:2: unknown fields ['colour']"),
        ("[1, 2]", "prompts.jsonl:2: each line must be a JSON object"),
        ('{"prompt": "x", "colour": "red"}', "prompts.jsonl:2: unknown fields ['colour']"),
        ('{"prompt": "x", "max_tokens": -1}',
         "prompts.jsonl:2: invalid job: max_tokens: Input should be greater than or equal to 1 (got -1)"),
        ('{"prompt": "x", "temperature": -1}', "prompts.jsonl:2: invalid job: sampling_config.temperature:"),
    ],
)
def test_cli_run_refuses_a_bad_file(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, match: str
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n' + line + "\n")
    out = tmp_path / "out.jsonl"
    assert cli(["jobs", "run", str(prompts), "--out", str(out), "--redis", redis_url]) == 1
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1, err
    assert redis.Redis.from_url(redis_url).exists("tokenwire:jobs") == 0


def test_job_spec_reads_openai_batch_lines_and_our_own():
    from clients.cli_jobs import job_spec

    line = {"custom_id": "q-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
                     "n": 2, "stop": "x", "stream": False, "temperature": 0}}  # fmt: skip
    assert job_spec(line) == ("q-1", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 5, "num_return_sequences": 2, "stop": ["x"],
                                      "temperature": 0})  # fmt: skip
    assert job_spec({"prompt": "x", "max_tokens": 3}) == (None, {"prompt": "x", "max_tokens": 3})
    assert job_spec({"custom_id": 7, "prompt": "x"}) == ("7", {"prompt": "x"})


def test_a_chat_job_carries_its_messages(redis_url: str):
    with JobQueue(redis_url) as q:
        (job_id,) = q.submit_many([{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}])
        blob = redis.Redis.from_url(redis_url).hget(f"tokenwire:job:{job_id}", "job")
        job = unpack_job(blob)  # type: ignore[arg-type]
        assert job.submit.messages is not None and job.submit.messages[0].content == "hi"
        assert job.submit.prompt is None and job.submit.input_token_ids is None


def test_cli_run_clean_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    missing = tmp_path / "missing.jsonl"
    assert cli(["jobs", "run", str(missing), "--out", str(tmp_path / "o"), "--redis", "redis://127.0.0.1:1/0"]) == 1
    assert capsys.readouterr().err.startswith(f"error: cannot read {missing}")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    assert cli(["jobs", "run", str(prompts), "--out", str(tmp_path / "o"), "--redis", "redis://127.0.0.1:1/0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: could not reach Redis at redis://127.0.0.1:1/0") and err.count("\n") == 1


def test_requeue_and_purge_dead_letters(redis_url: str, capsys: pytest.CaptureFixture[str]):
    r = redis.Redis.from_url(redis_url)
    with JobQueue(redis_url) as q:
        ids = q.submit_many([{"prompt": f"p{i}", "job_id": f"dead-{i}", "max_tokens": 2} for i in range(3)])
        for job_id in ids:  # as the consumer dead-letters a job
            blob = r.hget(f"tokenwire:job:{job_id}", "job")
            assert isinstance(blob, bytes)
            r.hset(f"tokenwire:job:{job_id}", "status", "dead")
            r.xadd("tokenwire:jobs:dead", {"job_id": job_id, "error": "boom", "deliveries": 5, "job": blob})
        assert cli(["jobs", "requeue", "--count", "2", "--redis", redis_url]) == 0
        assert "requeued 2" in capsys.readouterr().out
        assert q.status("dead-0") == JobStatus.QUEUED and q.status("dead-1") == JobStatus.QUEUED
        assert q.status("dead-2") == JobStatus.DEAD
        assert [d["job_id"] for d in q.dead_letters()] == ["dead-2"]
        assert cli(["jobs", "purge", "--redis", redis_url]) == 0
        assert "purged 1" in capsys.readouterr().out
        assert q.dead_letters() == []
