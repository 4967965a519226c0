"""`tokenwire worker` / `python -m worker.service`: run one worker process."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ops.config import add_config_options

if TYPE_CHECKING:
    from worker.executor import Executor

DEFAULT_BIND = "tcp://127.0.0.1:5600"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="SmolLM2-135M-Instruct",
        help="checkpoint directory, .gguf file, or the default model's name",
    )
    p.add_argument("--model-name", default=None, help="name gateways route on (default: the checkpoint's name)")
    p.add_argument("--bind", default=DEFAULT_BIND, help=f"ZeroMQ endpoint to bind (default {DEFAULT_BIND})")
    p.add_argument("--advertise", default="", help="address gateways connect to (default: the bound one)")
    p.add_argument("--redis", default=DEFAULT_REDIS, help=f"Redis URL (default {DEFAULT_REDIS})")
    p.add_argument("--redis-prefix", default="tokenwire")
    p.add_argument("--worker-id", default="", help="registry id (default host:port)")
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "numpy", "torch", "echo"],
        help="'echo' is for TRANSPORT TESTS ONLY: it returns the last prompt token, computing nothing",
    )
    p.add_argument("--device", default=None, help="torch device, e.g. cuda:0")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-num-tokens", type=int, default=2048)
    p.add_argument("--max-beam-width", type=int, default=4, help="widest beam search accepted")
    p.add_argument("--kv-tokens", type=int, default=None, help="KV cache size in tokens (default: from memory)")
    p.add_argument(
        "--logits-post-processor",
        action="append",
        default=[],
        metavar="NAME=MODULE:FUNCTION",
        help="a logits post-processor requests may name (clients cannot send code); repeatable",
    )
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds")
    p.add_argument(
        "--missed-heartbeats",
        type=int,
        default=3,
        help="a gateway silent for this many of its intervals is gone and its requests aborted",
    )
    p.add_argument("--cancel-poll-interval", type=float, default=0.25, help="seconds between Redis cancel polls")
    p.add_argument("--stats-stream-maxlen", type=int, default=1000, help="iteration stats kept in Redis")
    p.add_argument("--request-stats-ttl", type=float, default=3600.0, help="seconds a request's stats live")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="one event a line: text or JSON")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds in-flight requests get to finish after SIGTERM; a second SIGTERM ends them at once",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address /metrics listens on")
    # Makes the executor loop hang after this many seconds, so tests see the watchdog pings stop.
    p.add_argument("--test-hang-loop-after", type=float, default=None, help=argparse.SUPPRESS)
    add_config_options(p, "worker")


def model_name_of(path: Path) -> str:
    return path.stem if path.suffix == ".gguf" else path.name


GIL_SWITCH_INTERVAL_S = 0.0002


def build_executor(
    args: argparse.Namespace, on_iteration: Callable[[], None] | None = None
) -> tuple[Executor, Path]:
    from worker.executor import Executor, ExecutorConfig, KvCacheConfig
    from worker.models.default_model import resolve_model

    path = Path(args.model) if Path(args.model).exists() else resolve_model(args.model)
    config = ExecutorConfig(
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_beam_width=args.max_beam_width,
        kv_cache_config=KvCacheConfig(max_tokens=args.kv_tokens),
        logits_post_processors=tuple(args.logits_post_processor),
        backend="auto" if args.backend == "echo" else args.backend,
        device=args.device,
    )
    if args.backend != "echo":
        return Executor(path, config, on_iteration=on_iteration), path
    from worker.models.loader import load_model
    from worker.service.echo_backend import EchoBackend

    logging.getLogger(__name__).warning("echo backend: TRANSPORT TEST ONLY, no model runs")
    meta = load_model(path, load_weights=False)  # config and tokenizer: gateways detokenize as usual
    backend = EchoBackend(meta.config)
    return Executor(path, config, backend=backend, tokenizer=meta.tokenizer, on_iteration=on_iteration), path


def _loop_alive(ping: Callable[[], None], hang_after_s: float | None) -> Callable[[], None]:
    """The executor's on_iteration hook: the systemd watchdog ping (and the test hang)."""
    if hang_after_s is None:
        return ping
    hang_at = time.monotonic() + hang_after_s

    def hook() -> None:
        if time.monotonic() >= hang_at:
            logging.getLogger(__name__).warning("--test-hang-loop-after: the executor loop hangs now")
            threading.Event().wait()
        ping()

    return hook


def run(args: argparse.Namespace) -> int:
    from ops.config import apply_config
    from ops.logs import setup_logging
    from ops.process import exit_on_thread_crash, settle_gc
    from ops.sd_notify import Notifier
    from worker.service.server import ServiceConfig, WorkerService

    apply_config(args)
    setup_logging("worker", args.log_level, args.log_format)
    # The executor thread is the critical path, and the pump, socket and Redis threads
    # share its GIL: with Python's 5 ms switch interval one of them can keep it waiting
    # that long. 0.2 ms measured 11% more tokens/s through the service on an H200.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    exit_on_thread_crash()
    notifier = Notifier()
    notifier.status(f"loading {args.model}")
    executor, path = build_executor(args, _loop_alive(notifier.watchdog, args.test_hang_loop_after))
    service = WorkerService(
        executor,
        ServiceConfig(
            bind=args.bind,
            redis_url=args.redis,
            model_name=args.model_name or model_name_of(path),
            worker_id=args.worker_id,
            advertise=args.advertise,
            redis_prefix=args.redis_prefix,
            heartbeat_interval_s=args.heartbeat_interval,
            missed_heartbeats=args.missed_heartbeats,
            cancel_poll_interval_s=args.cancel_poll_interval,
            stats_stream_maxlen=args.stats_stream_maxlen,
            request_stats_ttl_s=args.request_stats_ttl,
            device=args.device or args.backend,
            drain_timeout_s=args.drain_timeout,
        ),
        notifier,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.request_drain())
    settle_gc()
    if args.metrics_port:
        service.metrics.serve(args.metrics_host, args.metrics_port)
    try:
        service.serve()
    finally:
        executor.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenwire worker", description="Run one worker: an executor behind ZeroMQ.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
