"""`tokenwire generate`, `tokenwire cancel` and `tokenwire stats`."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from clients.cli import Subparsers
from clients.cli_table import format_table
from ops.curve_options import add_client_curve_options, client_curve

DEFAULT_GATEWAY = "tcp://127.0.0.1:5550"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def register(subparsers: Subparsers) -> None:
    gen = subparsers.add_parser("generate", help="send one prompt to a gateway and print the completion")
    gen.add_argument("prompt")
    gen.add_argument(
        "--gateway",
        action="append",
        default=[],
        help=f"gateway endpoint, repeatable for failover (default {DEFAULT_GATEWAY})",
    )
    add_client_curve_options(gen)
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message, in the model's chat template"
    )
    gen.add_argument("--model", default=None)
    gen.add_argument("--lora", default=None, metavar="NAME", help="run under this LoRA adapter (a worker holds it)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string, repeatable")
    gen.add_argument("--request-id", default=None, help="default: a random id, printed to stderr")
    gen.add_argument("--timeout", type=float, default=300.0, help="seconds")
    gen.set_defaults(handler=generate)

    cancel = subparsers.add_parser("cancel", help="cancel a request by id, through a Redis flag")
    cancel.add_argument("request_id")
    cancel.add_argument("--redis", default=DEFAULT_REDIS)
    cancel.add_argument("--redis-prefix", default="tokenwire")
    cancel.set_defaults(handler=cancel_request)

    stats = subparsers.add_parser("stats", help="workers, their load and recent iterations, from Redis")
    stats.add_argument("--redis", default=DEFAULT_REDIS)
    stats.add_argument("--redis-prefix", default="tokenwire")
    stats.add_argument("--iterations", type=int, default=5, help="recent iterations shown per worker")
    stats.add_argument(
        "--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
        help="redraw every SECONDS (default 2) with live throughput, until Ctrl-C",
    )  # fmt: skip
    stats.set_defaults(handler=show_stats)


def generate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from clients.client import Client, RequestError, SamplingParams
    from clients.wire import to_submit

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop or [],
        lora=args.lora,
    )
    # A chat is the prompt as one user turn; the gateway applies the model's template.
    prompt, messages = (None, [{"role": "user", "content": args.prompt}]) if args.chat else (args.prompt, None)
    try:
        # Bad flags fail here, before any connection.
        to_submit(prompt, params, request_id=args.request_id, model=args.model, messages=messages)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        print(f"error: {problems}", file=sys.stderr)
        return 2
    with Client(args.gateway or [DEFAULT_GATEWAY], curve=client_curve(args)) as client:
        future = client.submit(
            prompt, params, request_id=args.request_id, model=args.model, streaming=args.stream, messages=messages
        )
        print(f"request {future.request_id}", file=sys.stderr)
        try:
            if args.stream:
                deadline = time.monotonic() + args.timeout
                for chunk in future.chunks(timeout=args.timeout):
                    print(chunk.text, end="", flush=True)
                print()
                result = future.result(timeout=max(0.0, deadline - time.monotonic()))
            else:
                result = future.result(timeout=args.timeout)
                print(result.text)
        except RequestError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except TimeoutError as e:
            future.cancel()
            print(f"error: {e}", file=sys.stderr)
            return 1
        reason = result.finish_reason.name.lower() if result.finish_reason is not None else "?"
        print(f"[{len(result.token_ids)} tokens, finish reason {reason}]", file=sys.stderr)
    return 0


def cancel_request(args: argparse.Namespace) -> int:
    import redis

    import protocol

    key = protocol.Keys(args.redis_prefix).cancel(args.request_id)
    try:
        redis.Redis.from_url(args.redis, socket_timeout=5).set(key, b"1", ex=protocol.CANCEL_TTL_S)
    except redis.RedisError as e:
        print(f"error: could not reach Redis at {args.redis}: {e}", file=sys.stderr)
        return 1
    print(f"cancel flag set for {args.request_id}; its worker stops it at its next poll")
    return 0


def show_stats(args: argparse.Namespace) -> int:
    if getattr(args, "watch", None):
        from clients.cli_watch import watch

        return watch(args, show_stats)
    import redis

    import protocol
    from clients.cli_watch import acceptance, with_acceptance

    keys = protocol.Keys(args.redis_prefix)
    # redis-py's return types are unions over its decode modes; this client returns bytes.
    r: Any = redis.Redis.from_url(args.redis, socket_timeout=5)
    try:
        workers = [(raw.decode(), score) for raw, score in r.zrange(keys.workers(), 0, -1, withscores=True)]
        rows = []
        recent: list[list[str]] = []
        now = time.time()
        for worker_id, seen in workers:
            info_blob, beat_blob = r.mget([keys.worker(worker_id), keys.heartbeat(worker_id)])
            if info_blob is None:
                continue  # expired
            info = protocol.decode(info_blob)
            assert isinstance(info, protocol.WorkerInfo)
            beat = protocol.decode(beat_blob) if beat_blob is not None else None
            load = beat.load if isinstance(beat, protocol.Heartbeat) and beat.load else protocol.WorkerLoad()
            rows.append(
                [
                    worker_id,
                    info.address,
                    ",".join(info.models),
                    info.device or "-",
                    str(load.num_queued_requests),
                    str(load.num_active_requests),
                    f"{load.free_num_blocks}/{load.max_num_blocks}",
                    f"{now - seen:.1f}",
                ]
            )
            for _, fields in reversed(r.xrevrange(keys.iteration_stats(worker_id), count=args.iterations)):
                f = {k.decode(): v.decode() for k, v in fields.items()}
                recent.append(
                    [
                        worker_id,
                        f["iter"],
                        f"{float(f['iter_latency_ms']):.2f}",
                        f["num_active_requests"],
                        f["num_queued_requests"],
                        f["num_scheduled_tokens"],
                        f"{f['free_num_blocks']}/{f['max_num_blocks']}",
                        acceptance(int(f.get("num_draft_tokens", 0)), int(f.get("num_accepted_draft_tokens", 0))),
                    ]
                )
    except redis.RedisError as e:
        print(f"error: could not read Redis at {args.redis}: {e}", file=sys.stderr)
        return 1
    if not rows:
        print("no live workers registered")
        return 0
    print(
        format_table(
            [
                "worker",
                "address",
                "models",
                "device",
                "queued",
                "active",
                "free KV blocks",
                "heartbeat age s",
            ],
            rows,
        )
    )
    if recent:
        print()
        print(
            format_table(
                *with_acceptance(["worker", "iter", "latency ms", "active", "queued", "tokens", "free blocks"],
                                 recent)
            )
        )
    return 0

