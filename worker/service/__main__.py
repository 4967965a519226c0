"""`tokenwire worker` / `python -m worker.service`: run one worker process."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ops.binds import Bind, add_insecure_option, check_binds, is_local_endpoint, metrics_bind
from ops.config import NON_NEGATIVE_FLOAT, PORT, POSITIVE_FLOAT, POSITIVE_INT, add_config_options
from ops.curve_options import add_curve_options, curve_config
from ops.secrets import add_redis_password_option, redis_url
from worker.service.kv_transport import MODES

if TYPE_CHECKING:
    from worker.executor.types import PeftCacheConfig, SpeculativeConfig

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
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both",
                   help="disaggregated serving: prefill workers compute prompts and first tokens, decode workers "
                   "take the rest with the prompts' KV blocks; both (the default) does whole requests")  # fmt: skip
    p.add_argument("--kv-bind", default=None, metavar="ENDPOINT",
                   help="ZeroMQ endpoint where this worker takes KV blocks from prefill workers "
                   "(needed by --role decode or both to decode what prefill workers computed)")  # fmt: skip
    p.add_argument("--kv-transfer", choices=MODES, default="auto",
                   help="how this worker sends prompts' KV blocks to decode workers: frames (host bytes over "
                   "ZeroMQ), cuda-ipc (a CUDA IPC handle of a device buffer: same host only), or auto (the "
                   "default: CUDA IPC where the KV cache is on CUDA and the decode worker on this host, frames "
                   "elsewhere); a handle that cannot be opened falls back to frames")  # fmt: skip
    p.add_argument("--redis", default=DEFAULT_REDIS, help=f"Redis URL (default {DEFAULT_REDIS})")
    add_redis_password_option(p)
    add_curve_options(p, "worker")
    p.add_argument("--redis-prefix", default="tokenwire")
    p.add_argument("--worker-id", default="", help="registry id (default host:port)")
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "numpy", "torch", "echo"],
        help="'echo' is for TRANSPORT TESTS ONLY: it returns the last prompt token, computing nothing",
    )
    p.add_argument("--device", default=None, help="torch device, e.g. cuda:0")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs (processes) the model is split over: the first N visible ones",
    )
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="mixture-of-experts models: each of the --tensor-parallel-size GPUs holds whole experts (a "
        "contiguous run of them; the expert count must divide by the size) instead of a slice of every expert",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="pipeline stages the layers are split into, each over --tensor-parallel-size GPUs "
        "(tp * pp processes, on the first tp * pp visible GPUs)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["fp8", "int4"],
        help="quantize a float checkpoint's linear layers on load: fp8 (per-channel weights, per-token "
        "activations) or int4 (group-wise round-to-nearest W4A16, not AWQ); quantized checkpoints "
        "(compressed-tensors, AWQ) need no flag",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["fp8"],
        help="the KV cache's element type: fp8 (e4m3, unscaled) holds twice the tokens in the same memory "
        "(torch backend); default: the model's dtype",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a LoRA adapter (Hugging Face PEFT directory) requests may name; repeatable. "
        "More can be loaded at run time (tokenwire lora load) when any LoRA option is given",
    )
    p.add_argument("--lora-dir", default=None, metavar="DIR",
                   help="a directory of LoRA adapters, one PEFT directory each, named by its subdirectory: "
                   "a request naming one not held loads it first; gateways route such requests here")  # fmt: skip
    p.add_argument("--max-loras", type=POSITIVE_INT, default=None,
                   help="LoRA adapters resident on the device at once (default: the executor's, 8)")
    p.add_argument("--max-cpu-loras", type=POSITIVE_INT, default=None,
                   help="LoRA adapters kept in host memory (default: the executor's, 32)")
    p.add_argument("--max-lora-rank", type=POSITIVE_INT, default=None,
                   help="the largest LoRA rank accepted (default: the executor's, 64)")
    p.add_argument("--max-batch-size", type=POSITIVE_INT, default=64)
    p.add_argument(
        "--scheduler-policy",
        default="guaranteed_no_evict",
        choices=["guaranteed_no_evict", "max_utilization"],
        help="admit a request when the KV cache holds it at its longest (never preempts; the default), or when "
        "it holds it now, preempting the newest by recompute when the cache fills: more throughput on long "
        "outputs (bf16 1000/1000 on an H100: +12 %%), later tokens for the preempted",
    )
    p.add_argument("--max-num-tokens", type=POSITIVE_INT, default=2048)
    p.add_argument("--deterministic", action="store_true",
                   help="a request's logits do not depend on the requests batched with it, so a seeded request "
                   "samples the same tokens whatever the load; costs throughput; float weights, one device")
    p.add_argument("--max-beam-width", type=POSITIVE_INT, default=4, help="widest beam search accepted")
    p.add_argument("--kv-tokens", type=POSITIVE_INT, default=None, help="KV cache size in tokens (default: by memory)")
    p.add_argument("--host-kv-cache-gb", type=NON_NEGATIVE_FLOAT, default=0.0, metavar="GB",
                   help="GiB of host memory (per GPU rank; pinned on CUDA) for a second KV cache tier: prefix blocks "
                   "evicted from the device are kept there and copied back on a hit, instead of recomputed "
                   "(default 0: off)")  # fmt: skip
    p.add_argument(
        "--logits-post-processor",
        action="append",
        default=[],
        metavar="NAME=MODULE:FUNCTION",
        help="a logits post-processor requests may name (clients cannot send code); repeatable",
    )
    p.add_argument(
        "--speculative",
        choices=["prompt_lookup", "draft_model"],
        default=None,
        help="speculative decoding for requests that do not choose (default: off; draft_model with --draft-model)",
    )
    p.add_argument("--num-draft-tokens", type=int, default=4, help="tokens proposed per speculative step")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="draft model (checkpoint directory or .gguf) sharing the model's tokenizer")
    p.add_argument("--cpu-threads", type=POSITIVE_INT, default=None,
                   help="threads the model's math libraries run (BLAS, torch on the CPU); default: the usable cores"
                        " but one, so the worker stays fast beside a gateway or a load generator on its cores")
    p.add_argument("--heartbeat-interval", type=POSITIVE_FLOAT, default=1.0, help="seconds")
    p.add_argument(
        "--missed-heartbeats",
        type=POSITIVE_INT,
        default=3,
        help="a gateway silent for this many of its intervals is gone and its requests aborted",
    )
    p.add_argument("--cancel-poll-interval", type=POSITIVE_FLOAT, default=0.25, help="seconds per Redis cancel poll")
    p.add_argument("--stats-stream-maxlen", type=POSITIVE_INT, default=1000, help="iteration stats kept in Redis")
    p.add_argument("--request-stats-ttl", type=POSITIVE_FLOAT, default=3600.0, help="seconds a request's stats live")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="one event a line: text or JSON")
    p.add_argument(
        "--drain-timeout",
        type=NON_NEGATIVE_FLOAT,
        default=60.0,
        help="seconds in-flight requests get to finish after SIGTERM; a second SIGTERM ends them at once",
    )
    p.add_argument("--metrics-port", type=PORT, default=0, help="serve Prometheus /metrics on this port (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address /metrics listens on")
    add_insecure_option(p)
    add_config_options(p, "worker")


def host_kv_cache_bytes(gib: float) -> int:
    """--host-kv-cache-gb in bytes; more than the host's memory is refused here, before
    the model loads, rather than by the pinned allocation failing minutes later."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if gib * (1 << 30) > total:
        raise SystemExit(f"tokenwire worker: --host-kv-cache-gb {gib:g} is more than this host's memory "
                         f"({total / (1 << 30):.1f} GiB)")
    return int(gib * (1 << 30))


def model_name_of(path: Path) -> str:
    return path.stem if path.suffix == ".gguf" else path.name


# The worker's threads relay messages and hold the GIL briefly; with Python's
# 5 ms switch interval one could still keep another waiting that long.
GIL_SWITCH_INTERVAL_S = 0.0002


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The worker's default speculative decoding, from --speculative / --draft-model."""
    from worker.executor.types import DraftSource, SpeculativeConfig

    source = args.speculative or ("draft_model" if args.draft_model else None)
    if source is None:
        return None
    if source == "draft_model" and not args.draft_model:
        raise SystemExit("--speculative draft_model needs --draft-model DIR")
    return SpeculativeConfig(DraftSource(source), args.num_draft_tokens)


def disaggregation_problem(args: argparse.Namespace, curve: bool) -> str | None:
    """Why --role and --kv-bind cannot be served as given (None: they can)."""
    if args.role == "decode" and args.kv_bind is None:
        return "--role decode needs --kv-bind: a decode worker takes its prompts' KV blocks there"
    if args.kv_bind is not None and curve:
        return "--kv-bind: KV transfers are not encrypted (CURVE) yet; run disaggregated workers without CURVE"
    ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    if (args.role != "both" or args.kv_bind is not None) and ranks > 1:
        return ("--role and --kv-bind: KV transfers move one rank's KV cache; tensor and pipeline parallel "
                "workers run whole requests (--role both, no --kv-bind)")
    return None


def lora_options(args: argparse.Namespace) -> tuple[tuple[tuple[str, str], ...], PeftCacheConfig | None]:
    """The adapters of --lora NAME=DIR, and the adapter cache's bounds (None: LoRA off; --lora-dir turns it on)."""
    from worker.executor.types import PeftCacheConfig

    adapters = []
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora {spec!r}: give NAME=DIR")
        if not Path(path).is_dir():  # said now, not after the model loads (minutes, on a GPU)
            raise SystemExit(f"--lora {spec!r}: {path} is not a directory (a PEFT adapter's)")
        adapters.append((name, path))
    names = [name for name, _ in adapters]
    if len(set(names)) != len(names):
        raise SystemExit(f"--lora: each adapter name once; got {names}")
    if args.lora_dir is not None and not Path(args.lora_dir).is_dir():
        raise SystemExit(f"--lora-dir {args.lora_dir}: not a directory")
    bounds = {"max_device_adapters": args.max_loras, "max_host_adapters": args.max_cpu_loras,
              "max_rank": args.max_lora_rank}  # fmt: skip
    given = {key: value for key, value in bounds.items() if value is not None}
    if not adapters and not given and args.lora_dir is None:
        return (), None
    return tuple(adapters), PeftCacheConfig(**given)


def run(args: argparse.Namespace) -> int:
    from ops.config import apply_config
    from ops.logs import setup_logging
    from ops.process import exit_on_thread_crash, settle_gc, stop_with_launcher
    from ops.sd_notify import Notifier
    from worker.service.engine import EngineConfig, EngineFailed, EngineProcess
    from worker.service.kv_transport import KvTransportError
    from worker.service.server import Listener, ListenError, ServiceConfig, WorkerService

    apply_config(args)
    host_kv_bytes = host_kv_cache_bytes(args.host_kv_cache_gb)
    args.redis = redis_url(args.redis, DEFAULT_REDIS, args.redis_password_file)
    curve = curve_config(args)
    binds = [Bind("--bind", args.bind, is_local_endpoint(args.bind), curve is not None, "--curve-secret-key-file")]
    if args.metrics_port:
        binds.append(metrics_bind(args.metrics_host))
    if problem := disaggregation_problem(args, curve is not None):
        raise SystemExit(problem)
    if args.kv_bind is not None:
        binds.append(Bind("--kv-bind", args.kv_bind, is_local_endpoint(args.kv_bind), False,
                          "a private network between workers"))  # fmt: skip
    open_binds = check_binds("worker", binds, args.insecure)
    setup_logging("worker", args.log_level, args.log_format)
    for warning in open_binds:
        logging.getLogger(__name__).warning("insecure: %s", warning)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    exit_on_thread_crash()
    stop_with_launcher()
    try:  # bound before the model loads (minutes, on a GPU): a port in use is reported at once
        listener = Listener.open(args.bind, curve, args.metrics_host, args.metrics_port)
    except ListenError as e:
        logging.getLogger(__name__).critical("%s", e)
        return 1
    lora_adapters, peft_cache_config = lora_options(args)
    notifier = Notifier()
    notifier.status(f"loading {args.model}")
    engine_config = EngineConfig(
        model=args.model,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_beam_width=args.max_beam_width,
        scheduler_policy=args.scheduler_policy,
        kv_tokens=args.kv_tokens,
        host_kv_cache_bytes=host_kv_bytes,
        logits_post_processors=tuple(args.logits_post_processor),
        backend=args.backend,
        device=args.device,
        log_level=args.log_level,
        log_format=args.log_format,
        speculative_config=speculative_config(args),
        draft_model=args.draft_model,
        cpu_threads=args.cpu_threads,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        expert_parallel=args.expert_parallel,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        lora_adapters=lora_adapters,
        peft_cache_config=peft_cache_config,
        deterministic=args.deterministic,
    )
    try:
        engine = EngineProcess(engine_config)
    except EngineFailed as e:
        logging.getLogger(__name__).critical("%s", e)
        listener.close()
        return 1
    try:
        service = WorkerService(
            engine,
            ServiceConfig(
                bind=args.bind,
                redis_url=args.redis,
                model_name=args.model_name or model_name_of(engine.info.model_path),
                worker_id=args.worker_id,
                advertise=args.advertise,
                redis_prefix=args.redis_prefix,
                heartbeat_interval_s=args.heartbeat_interval,
                missed_heartbeats=args.missed_heartbeats,
                cancel_poll_interval_s=args.cancel_poll_interval,
                stats_stream_maxlen=args.stats_stream_maxlen,
                request_stats_ttl_s=args.request_stats_ttl,
                device=args.device or engine.info.backend,  # what auto chose, for `tokenwire stats`
                drain_timeout_s=args.drain_timeout,
                curve=curve,
                lora_dir=args.lora_dir,
                role=args.role,
                kv_bind=args.kv_bind,
                kv_transfer=args.kv_transfer,
            ),
            notifier,
            listener,
        )
        service.metrics.model = service.config.model_name
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: service.request_drain())
        settle_gc()
        service.serve()
    except KvTransportError as e:
        logging.getLogger(__name__).critical("%s", e)
        listener.close()
        return 1
    finally:
        engine.shutdown()
    return 1 if service.engine_failure else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenwire worker", description="Run one worker: an executor behind ZeroMQ.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
