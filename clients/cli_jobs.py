"""`tokenwire jobs submit|status|result|cancel|run|consume|stats`: the job queue."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import IO, Any

from clients.cli import Subparsers
from clients.cli_requests import DEFAULT_GATEWAY, DEFAULT_REDIS
from clients.cli_table import format_table
from clients.jobs_openai_batch import body_spec
from clients.params import SamplingParams
from ops.config import POSITIVE_FLOAT, POSITIVE_INT, add_config_options
from ops.curve_options import add_client_curve_options, client_curve
from ops.secrets import add_redis_password_option, redact, redis_url

# Keys a line of a `jobs run` file may hold besides "prompt" or "messages": submit's keyword arguments.
_JOB_FIELDS = frozenset(["job_id", "deadline_s", "result_ttl_s", "model", "tools", "tool_choice", "parallel_tool_calls",
                         "embedding", *(f.name for f in fields(SamplingParams))])  # fmt: skip


def job_spec(line: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """A `jobs run` line as (custom_id, submit's keyword arguments): OpenAI's batch
    input format ({"custom_id", "method", "url", "body": {...}}) or tokenwire's own
    ({"prompt" or "messages", options...}, "custom_id" optional). ValueError names
    what is wrong."""
    custom_id = line.get("custom_id")
    if "body" in line:
        body = line["body"]
        if not isinstance(body, dict):
            raise ValueError('"body" must be an object')
        spec = body_spec(line.get("url"), body)
    else:
        spec = {k: v for k, v in line.items() if k != "custom_id"}
    if ("prompt" in spec) == ("messages" in spec):
        raise ValueError('each line needs a "prompt" or chat "messages" (in "body" for OpenAI\'s batch format)')
    unknown = set(spec) - _JOB_FIELDS - {"prompt", "messages"}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}; known: {sorted(_JOB_FIELDS)}")
    return None if custom_id is None else str(custom_id), spec


def register(subparsers: Subparsers) -> None:
    jobs = subparsers.add_parser("jobs", help="the durable job queue in Redis: submit, follow, consume")
    sub = jobs.add_subparsers(title="jobs commands", metavar="JOBS_COMMAND")
    jobs.set_defaults(handler=lambda _: (jobs.print_help(), 2)[1])

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--redis", default=DEFAULT_REDIS)
        add_redis_password_option(p)
        p.add_argument("--redis-prefix", default="tokenwire")
        return p

    p = command("submit", "queue one job; prints its id")
    p.add_argument("prompt")
    p.add_argument("--job-id", default=None, help="your id, for idempotency (default: a random one)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--lora", default=None, metavar="NAME", help="run under this LoRA adapter (a worker holds it)")
    p.add_argument("--priority", type=float, default=0.5, help="0..1, the workers' scheduling priority")
    p.add_argument("--deadline", type=float, default=None, help="seconds from now; later it ends expired")
    p.set_defaults(handler=submit)

    p = command("status", "a job's status, deliveries and last error")
    p.add_argument("job_id")
    p.set_defaults(handler=status)

    p = command("result", "print a job's result as JSON, waiting for it")
    p.add_argument("job_id")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for it to end (default: none)")
    p.set_defaults(handler=result)

    p = command("cancel", "cancel a queued or running job")
    p.add_argument("job_id")
    p.set_defaults(handler=cancel)

    p = command("run", "queue every line of a JSONL file, wait, write the results as JSONL")
    p.add_argument(
        "prompts",
        type=Path,
        help='one JSON object a line: {"prompt" or "messages": ..., "max_tokens": ..., ...}, or OpenAI\'s batch '
        'input format ({"custom_id": ..., "body": {"messages": ...}}); results echo custom_id and the line number',
    )
    p.add_argument("--out", type=Path, required=True, help="results, one JSON object a line, as jobs end")
    p.add_argument("--max-tokens", type=int, default=64, help="for lines that do not say")
    p.add_argument("--timeout", type=float, default=None, help="seconds to wait for all (default: no limit)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=run)

    p = command("consume", "run a job consumer: jobs from Redis to gateways, results back")
    p.add_argument("--gateway", action="append", default=[], help=f"repeatable (default {DEFAULT_GATEWAY})")
    p.add_argument("--name", default="", help="consumer name in the group (default host-pid)")
    p.add_argument("--max-in-flight", type=POSITIVE_INT, default=256)
    p.add_argument(
        "--idle-timeout", type=POSITIVE_FLOAT, default=30.0, help="seconds before a silent job is taken over"
    )
    p.add_argument("--max-deliveries", type=POSITIVE_INT, default=5, help="then the job is dead-lettered")
    p.add_argument("--heartbeat-interval", type=POSITIVE_FLOAT, default=1.0, help="to the gateway, seconds")
    p.add_argument("--missed-heartbeats", type=POSITIVE_INT, default=3)
    add_client_curve_options(p)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="one event a line: text or JSON")
    add_config_options(p, "jobs_consumer")
    p.set_defaults(handler=consume)

    p = command("requeue", "queue dead-lettered jobs again, the oldest first")
    p.add_argument("--count", type=int, default=None, help="how many (default: all)")
    p.set_defaults(handler=requeue)

    p = command("purge", "drop every dead-lettered job")
    p.set_defaults(handler=purge)

    p = command("stats", "queued, in flight, done, failed, dead-lettered, throughput")
    p.add_argument("--dead", type=int, default=5, help="recent dead letters shown")
    p.set_defaults(handler=stats)


def _queue(args: argparse.Namespace) -> Any:
    from clients.jobs import JobQueue

    return JobQueue(redis_url(args.redis, DEFAULT_REDIS, args.redis_password_file), prefix=args.redis_prefix)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def submit(args: argparse.Namespace) -> int:
    import redis

    from clients.jobs import JobSpecError

    with _queue(args) as q:
        try:
            job_id = q.submit(
                args.prompt, job_id=args.job_id, max_tokens=args.max_tokens, temperature=args.temperature,
                seed=args.seed, model=args.model, lora=args.lora, priority=args.priority, deadline_s=args.deadline,
            )  # fmt: skip
        except JobSpecError as e:
            return _fail(str(e))
        except redis.RedisError as e:
            return _fail(f"could not reach Redis at {redact(args.redis)}: {e}")
    print(job_id)
    return 0


def status(args: argparse.Namespace) -> int:
    with _queue(args) as q:
        info = q.info(args.job_id)
    if not info:
        return _fail(f"no job {args.job_id!r} (never submitted, or its result expired)")
    print(json.dumps(info, indent=1, sort_keys=True))
    return 0


def result(args: argparse.Namespace) -> int:
    with _queue(args) as q:
        try:
            res = q.result(args.job_id, timeout=args.wait)
        except TimeoutError:
            now = q.status(args.job_id)
            if now is None:
                return _fail(f"no job {args.job_id!r} (never submitted, or its result expired)")
            return _fail(f"job {args.job_id} is {now.value}; no result yet")
    print(res.model_dump_json())
    return 0


def cancel(args: argparse.Namespace) -> int:
    with _queue(args) as q:
        now = q.cancel(args.job_id)
    if now is None:
        return _fail(f"no job {args.job_id!r}")
    print(f"job {args.job_id}: {now.value}")
    return 0


def run(args: argparse.Namespace) -> int:
    import redis

    from clients.jobs import JobSpecError

    specs, origins = [], []
    try:
        lines = args.prompts.read_text().splitlines()
    except OSError as e:
        return _fail(f"cannot read {args.prompts}: {e.strerror or e}")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("each line must be a JSON object")
            custom_id, spec = job_spec(obj)
        except json.JSONDecodeError as e:
            return _fail(f"{args.prompts}:{n}: not JSON: {e}")
        except ValueError as e:
            return _fail(f"{args.prompts}:{n}: {e}")
        specs.append({"max_tokens": args.max_tokens, **spec})
        origins.append({"custom_id": custom_id, "line": n})
    with _queue(args) as q:
        try:
            ids = q.submit_many(specs)
            consumers = q.stats().consumers
        except JobSpecError as e:
            return _fail(f"{args.prompts}:{origins[e.index]['line']}: {e}")
        except redis.RedisError as e:
            return _fail(f"could not reach Redis at {args.redis}: {e}")
        origin = dict(zip(ids, origins, strict=True))  # a repeated job id is one job: its last line
        ids = list(dict.fromkeys(ids))
        print(f"queued {len(ids)} jobs", file=sys.stderr)
        if not consumers:
            print("warning: no job consumer has joined this queue: jobs wait until one runs "
                  "(`tokenwire jobs consume`, or `tokenwire up`, which starts one)", file=sys.stderr)  # fmt: skip
        bar = _Progress(len(ids), None if args.quiet else sys.stderr)
        counts: dict[str, int] = {}
        with args.out.open("w") as out:
            try:
                for res in q.results(ids, timeout=args.timeout):
                    out.write(json.dumps({**origin[res.job_id], **res.model_dump(mode="json")}) + "\n")
                    counts[res.status.value] = counts.get(res.status.value, 0) + 1
                    bar.step()
            except TimeoutError as e:
                bar.close()
                return _fail(str(e))
        bar.close()
    print(", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + f"; results in {args.out}", file=sys.stderr)
    return 0 if counts.get("done", 0) == len(ids) else 1


class _Progress:
    """A one-line progress bar on a terminal stream (redrawn at most 10 times a second)."""

    def __init__(self, total: int, stream: IO[str] | None) -> None:
        self.total = total
        self.stream = stream
        self.done = 0
        self.start = time.monotonic()
        self.drawn = 0.0

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.stream is not None and (now - self.drawn > 0.1 or self.done == self.total):
            self.drawn = now
            width = 30
            filled = width * self.done // max(1, self.total)
            rate = self.done / max(1e-9, now - self.start)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {rate:.1f} jobs/s")
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")


def consume(args: argparse.Namespace) -> int:
    import signal

    from clients.jobs_consumer import Consumer, ConsumerConfig
    from ops.config import apply_config
    from ops.logs import setup_logging
    from ops.process import stop_with_launcher
    from ops.sd_notify import Notifier

    apply_config(args)
    args.redis = redis_url(args.redis, DEFAULT_REDIS, args.redis_password_file)
    setup_logging("consumer", args.log_level, args.log_format)
    stop_with_launcher()
    consumer = Consumer(
        ConsumerConfig(
            redis_url=args.redis,
            gateways=args.gateway or [DEFAULT_GATEWAY],
            prefix=args.redis_prefix,
            name=args.name,
            max_in_flight=args.max_in_flight,
            idle_timeout_s=args.idle_timeout,
            max_deliveries=args.max_deliveries,
            heartbeat_interval_s=args.heartbeat_interval,
            missed_heartbeats=args.missed_heartbeats,
            curve=client_curve(args),
        )
    )
    consumer.notifier = Notifier()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: consumer.stop.set())
    consumer.run()
    return 0


def requeue(args: argparse.Namespace) -> int:
    import redis

    with _queue(args) as q:
        try:
            ids = q.requeue_dead(args.count)
        except redis.RedisError as e:
            return _fail(f"could not reach Redis at {args.redis}: {e}")
    print(f"requeued {len(ids)} jobs" + (f": {', '.join(ids)}" if ids else ""))
    return 0


def purge(args: argparse.Namespace) -> int:
    import redis

    with _queue(args) as q:
        try:
            n = q.purge_dead()
        except redis.RedisError as e:
            return _fail(f"could not reach Redis at {args.redis}: {e}")
    print(f"purged {n} dead-lettered jobs")
    return 0


def stats(args: argparse.Namespace) -> int:
    import redis

    with _queue(args) as q:
        try:
            s = q.stats()
            dead = q.dead_letters(args.dead) if args.dead else []
        except redis.RedisError as e:
            return _fail(f"could not read Redis at {redact(args.redis)}: {e}")
    header = ["queued", "in flight", "submitted", "done", "failed deliveries", "cancelled", "expired",
              "dead-lettered", "consumers", "done/s (10 s)"]  # fmt: skip
    row = [s.queued, s.in_flight, s.submitted, s.done, s.failures, s.cancelled, s.expired, s.dead, s.consumers]
    print(format_table(header, [[*map(str, row), f"{s.done_per_s:.1f}"]]))
    if dead:
        print()
        rows = [[d.get("job_id", "?"), d.get("deliveries", "?"), d.get("error", "")[:100]] for d in dead]
        print(format_table(["dead job", "deliveries", "last error"], rows))
    return 0
