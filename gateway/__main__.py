"""`tokenwire gateway` / `python -m gateway`: run one gateway process."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from gateway.api_keys import add_api_key_options
from ops.binds import add_insecure_option
from ops.config import NON_NEGATIVE_INT, PORT, POSITIVE_FLOAT, POSITIVE_INT, add_config_options
from ops.curve_options import add_curve_options, curve_config
from ops.secrets import add_redis_password_option
from protocol.keys import RESPONSE_TTL_S

DEFAULT_BIND = "tcp://127.0.0.1:5550"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bind", default=DEFAULT_BIND, help=f"ZeroMQ endpoint for clients (default {DEFAULT_BIND})")
    p.add_argument("--redis", default=DEFAULT_REDIS, help=f"Redis URL (default {DEFAULT_REDIS})")
    add_redis_password_option(p)
    add_curve_options(p, "gateway")
    p.add_argument("--redis-prefix", default="tokenwire")
    p.add_argument("--gateway-id", default="", help="id workers know this gateway by (default gw-host-pid)")
    p.add_argument("--heartbeat-interval", type=POSITIVE_FLOAT, default=1.0, help="seconds")
    p.add_argument("--missed-heartbeats", type=POSITIVE_INT, default=3, help="silent intervals before a peer is gone")
    p.add_argument("--max-inflight", type=POSITIVE_INT, default=4096, help="requests in flight, whole gateway")
    p.add_argument("--max-inflight-per-client", type=POSITIVE_INT, default=1024)
    p.add_argument("--client-send-limit", type=POSITIVE_INT, default=10_000,
                   help="messages a ZeroMQ client may leave unread before it is cut off (its requests cancelled)")
    p.add_argument("--migration-limit", type=NON_NEGATIVE_INT, default=3,
                   help="times one request may be moved to another worker when its worker is lost (0: never)")
    p.add_argument(
        "--no-worker-timeout", type=POSITIVE_FLOAT, default=10.0, help="seconds a request waits for a worker"
    )
    p.add_argument("--drain-timeout", type=POSITIVE_FLOAT, default=30.0,
                   help="after SIGTERM, seconds the requests in flight may take (a second SIGTERM: none)")
    p.add_argument("--tokenizer-sha256", action="append", default=[], metavar="MODEL=SHA256",
                   help="refuse workers of MODEL whose tokenizer.json has another SHA-256 (repeatable)")
    p.add_argument("--router", default="prefix", choices=["prefix", "least-loaded"],
                   help="route by the prompt blocks a worker's KV cache holds and its load, or by load alone")
    p.add_argument("--overlap-weight", type=POSITIVE_FLOAT, default=4.0,
                   help="prefix routing: the cost of a prompt block to compute, in blocks held by decoding requests")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="one event a line: text or JSON")
    p.add_argument("--metrics-port", type=PORT, default=0, help="serve Prometheus /metrics on this port (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address /metrics listens on")
    p.add_argument(
        "--http-port", type=PORT, default=0, help="serve the OpenAI-compatible HTTP API on this port (0: off)"
    )
    p.add_argument("--http-host", default="127.0.0.1", help="address the HTTP API listens on")
    p.add_argument("--response-ttl", type=POSITIVE_INT, default=RESPONSE_TTL_S, metavar="SECONDS",
                   help="how long stored Responses API responses are kept in Redis (default 30 days)")
    p.add_argument("--http-reuse-port", action="store_true",
                   help="share the HTTP port with the other gateway processes of this host that set it too "
                        "(SO_REUSEPORT): the kernel spreads new connections over them")  # fmt: skip
    add_api_key_options(p)
    add_insecure_option(p)
    p.add_argument("--tool-parser", choices=["hermes", "llama3_json", "mistral"], default=None,
                   help="how the HTTP API reads tool calls in a chat's output (default: the chat template's format)")
    p.add_argument("--reasoning-parser", choices=["think", "deepseek_r1"], default=None,
                   help="how the HTTP API splits a chat's reasoning from its content (default: from the chat template)")
    add_config_options(p, "gateway")


def run(args: argparse.Namespace) -> int:
    import zmq

    import protocol
    from gateway.api_keys import ApiKeyError, ApiKeys
    from gateway.server import Gateway, GatewayConfig
    from ops.binds import Bind, check_binds, is_local_endpoint, is_local_host, metrics_bind
    from ops.config import apply_config
    from ops.logs import setup_logging
    from ops.process import exit_on_thread_crash, settle_gc, stop_with_launcher
    from ops.sd_notify import Notifier
    from ops.secrets import redis_url

    apply_config(args)
    args.redis = redis_url(args.redis, DEFAULT_REDIS, args.redis_password_file)
    curve = curve_config(args)
    try:
        api_keys = ApiKeys.from_args(args, args.redis, protocol.Keys(args.redis_prefix))
    except ApiKeyError as e:
        raise SystemExit(f"tokenwire gateway: {e}") from None
    binds = [Bind("--bind", args.bind, is_local_endpoint(args.bind), curve is not None or api_keys is not None,
                  "--curve-secret-key-file or API keys (--api-keys-file, --api-keys-redis)")]
    if args.http_port:
        binds.append(Bind("--http-host", args.http_host, is_local_host(args.http_host), api_keys is not None,
                          "API keys (--api-keys-file, --api-keys-redis)"))
    if args.metrics_port:
        binds.append(metrics_bind(args.metrics_host))
    insecure = check_binds("gateway", binds, args.insecure)
    setup_logging("gateway", args.log_level, args.log_format)
    for warning in insecure:
        logging.getLogger("gateway").warning("insecure: %s", warning)
    exit_on_thread_crash()
    stop_with_launcher()
    try:  # every socket bound before serving: a port in use is one line and exit status 1
        gw = Gateway(
            GatewayConfig(
                bind=args.bind,
                redis_url=args.redis,
                gateway_id=args.gateway_id,
                redis_prefix=args.redis_prefix,
                heartbeat_interval_s=args.heartbeat_interval,
                missed_heartbeats=args.missed_heartbeats,
                max_inflight=args.max_inflight,
                max_inflight_per_client=args.max_inflight_per_client,
                client_send_limit=args.client_send_limit,
                migration_limit=args.migration_limit,
                no_worker_timeout_s=args.no_worker_timeout,
                drain_timeout_s=args.drain_timeout,
                tokenizer_sha256=dict(pin.split("=", 1) for pin in args.tokenizer_sha256),
                curve=curve,
                insecure=insecure,
                router=args.router,
                overlap_weight=args.overlap_weight,
                tool_parser=args.tool_parser,
            ),
            api_keys,
        )
        http = None
        if args.http_port:
            from gateway.http_front import HttpFront  # Starlette and uvicorn load only for it

            open_paths = frozenset(p.strip() for p in args.auth_open_paths.split(",") if p.strip())
            http = HttpFront(gw, args.http_host, args.http_port, open_paths, reasoning_parser=args.reasoning_parser,
                             reuse_port=args.http_reuse_port, response_ttl_s=args.response_ttl)  # fmt: skip
        if args.metrics_port:
            gw.metrics.serve(args.metrics_host, args.metrics_port)
    except (zmq.ZMQError, OSError) as e:
        logging.getLogger("gateway").critical("cannot listen: %s (is another gateway running on that port?)", e)
        return 1
    gw.notifier = Notifier()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: gw.request_drain())
    settle_gc()
    if http is not None:
        http.start()
    gw.serve()
    if http is not None:
        http.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenwire gateway", description="Run one gateway.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
