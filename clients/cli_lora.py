"""`tokenwire lora list|load|unload`: LoRA adapters on the running workers."""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from clients.cli import Subparsers
from clients.cli_table import format_table
from ops.secrets import add_redis_password_option, redact, redis_url

if TYPE_CHECKING:
    from protocol import WorkerInfo

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def register(subparsers: Subparsers) -> None:
    lora = subparsers.add_parser("lora", help="LoRA adapters on the running workers: list, load, unload")
    sub = lora.add_subparsers(title="lora commands", metavar="COMMAND")
    lora.set_defaults(handler=lambda _: (lora.print_help(), 2)[1])

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--redis", default=DEFAULT_REDIS, help="where the worker registry is")
        add_redis_password_option(p)
        p.add_argument("--redis-prefix", default="tokenwire")
        return p

    def targets(p: argparse.ArgumentParser) -> None:
        p.add_argument("--worker", action="append", default=[], metavar="ID",
                       help="a worker id (tokenwire stats lists them), repeatable; default: every worker "
                       "(of --model)")  # fmt: skip
        p.add_argument("--model", default=None, help="only the workers serving this model")
        p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each worker")
        p.add_argument("--curve-secret-key-file", default=None, metavar="FILE",
                       help="a CURVE key pair the workers accept (a gateway's); their public keys come from "
                       "the registry")  # fmt: skip

    p = command("list", "the adapters each worker holds, and those it loads when a request names one")
    p.set_defaults(handler=list_adapters)

    p = command("load", "register an adapter on workers, from a PEFT directory on their hosts")
    p.add_argument("name")
    p.add_argument("path", help="the adapter's directory (adapter_config.json, adapter_model.safetensors), "
                   "as the worker's host sees it")  # fmt: skip
    targets(p)
    p.set_defaults(handler=load)

    p = command("unload", "forget an adapter on workers: requests naming it then fail")
    p.add_argument("name")
    targets(p)
    p.set_defaults(handler=unload)


def list_adapters(args: argparse.Namespace) -> int:
    workers = _registered(args)
    if workers is None:
        return 1
    if not workers:
        print("no live workers registered")
        return 0
    rows = [[w.worker_id, ",".join(w.models), ",".join(w.lora_adapters) or "-", ",".join(w.lora_loadable) or "-"]
            for w in workers]  # fmt: skip
    print(format_table(["worker", "models", "LoRA adapters", "loadable (--lora-dir)"], rows))
    return 0


def _registered(args: argparse.Namespace) -> list[WorkerInfo] | None:
    """The live workers in the registry, or None (said on stderr) when Redis cannot be read."""
    import redis

    from clients.lora_control import registered_workers

    try:
        return registered_workers(redis_url(args.redis, DEFAULT_REDIS, args.redis_password_file), args.redis_prefix)
    except redis.RedisError as e:
        print(f"error: could not read Redis at {redact(args.redis)}: {e}", file=sys.stderr)
        return None


def load(args: argparse.Namespace) -> int:
    import protocol

    return _change(args, protocol.LoraLoad(request_id=uuid.uuid4().hex, name=args.name, path=args.path))


def unload(args: argparse.Namespace) -> int:
    import protocol

    return _change(args, protocol.LoraUnload(request_id=uuid.uuid4().hex, name=args.name))


def _change(args: argparse.Namespace, msg: object) -> int:
    """The load or unload on each target worker; 1 if any refused it or did not answer."""

    import protocol
    from clients.lora_control import LoraControlError, change_lora
    from ops.curve import CurveError, load_keypair

    assert isinstance(msg, protocol.LoraLoad | protocol.LoraUnload)
    try:
        keypair = None if args.curve_secret_key_file is None else load_keypair(Path(args.curve_secret_key_file))
    except CurveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    workers = _registered(args)
    if workers is None:
        return 1
    chosen = [w for w in workers if (not args.worker or w.worker_id in args.worker)
              and (args.model is None or args.model in w.models)]  # fmt: skip
    missing = sorted(set(args.worker) - {w.worker_id for w in workers})
    if missing or not chosen:
        print(f"error: no live worker {missing or 'matches'}; registered: {[w.worker_id for w in workers]}",
              file=sys.stderr)  # fmt: skip
        return 1
    failed = 0
    for w in chosen:
        if keypair is not None and w.curve_public_key is None:
            print(f"{w.worker_id}: error: it has no CURVE key in the registry", file=sys.stderr)
            failed += 1
            continue
        curve = None if keypair is None or w.curve_public_key is None else (keypair, w.curve_public_key.encode())
        try:
            adapters = change_lora(w.address, msg, timeout_s=args.timeout, curve=curve)
        except (LoraControlError, TimeoutError) as e:
            print(f"{w.worker_id}: error: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"{w.worker_id}: {msg.kind.replace('lora_', '')}ed {msg.name}; holds {', '.join(adapters) or 'none'}")
    return 1 if failed else 0
