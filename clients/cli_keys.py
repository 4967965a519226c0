"""`tokenwire keys`: CURVE key pairs (generate), and the API keys gateways accept
from Redis (add, revoke, list, usage). An API key is shown once, when added;
Redis holds only its SHA-256 (protocol/api_keys.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from clients.cli import Subparsers
from ops.secrets import add_redis_password_option, redis_url

if TYPE_CHECKING:
    import redis

    from protocol import Keys
    from protocol.api_keys import ApiKeyRecord

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def register(subparsers: Subparsers) -> None:
    keys = subparsers.add_parser("keys", help="CURVE keys and API keys (docs/security.md)")
    commands = keys.add_subparsers(title="commands", metavar="COMMAND", required=True)
    generate = commands.add_parser(
        "generate", help="write DIR/NAME.key (public: give it to the peers) and DIR/NAME.key_secret (keep it here)"
    )
    generate.add_argument("dir", type=Path)
    generate.add_argument("name")
    generate.set_defaults(handler=generate_keys)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = commands.add_parser(name, help=help)
        p.add_argument("--redis", default=DEFAULT_REDIS)
        add_redis_password_option(p)
        p.add_argument("--redis-prefix", default="tokenwire")
        return p

    add = command("add", "make an API key NAME, store its hash in Redis and print it (shown this once)")
    add.add_argument("name")
    add.add_argument("--max-concurrent", type=int, default=None, help="requests in flight at once, all gateways")
    add.add_argument("--requests-per-minute", type=int, default=None)
    add.add_argument("--tokens-per-minute", type=int, default=None, help="prompt and output tokens")
    add.set_defaults(handler=add_key)
    revoke = command("revoke", "revoke the API key NAME: every gateway refuses it within seconds")
    revoke.add_argument("name")
    revoke.set_defaults(handler=revoke_key)
    command("list", "the API keys in Redis: name, limits, created").set_defaults(handler=list_keys)
    usage = command("usage", "requests and tokens served per API key")
    usage.add_argument("name", nargs="?", default=None, help="one key (default: all)")
    usage.set_defaults(handler=key_usage)


def generate_keys(args: argparse.Namespace) -> int:
    from ops.curve import CurveError, generate

    try:
        public, secret = generate(args.dir, args.name)
    except CurveError as e:
        print(f"tokenwire keys generate: {e}", file=sys.stderr)
        return 1
    print(f"public key: {public}\nsecret key: {secret} (mode 600; never copy it off this host)")
    return 0


def _store(args: argparse.Namespace) -> tuple[redis.Redis, Keys]:
    import redis

    import protocol

    r = redis.Redis.from_url(redis_url(args.redis, DEFAULT_REDIS, args.redis_password_file))
    return r, protocol.Keys(args.redis_prefix)


def _records(r: redis.Redis, keys: Keys) -> dict[str, tuple[str, ApiKeyRecord]]:
    """Name -> (hash, record) of every stored key."""
    from protocol.api_keys import ApiKeyRecord

    out: dict[str, tuple[str, ApiKeyRecord]] = {}
    stored: dict[bytes, bytes] = r.hgetall(keys.api_keys())  # type: ignore[assignment]
    for digest, blob in stored.items():
        record = ApiKeyRecord.model_validate_json(blob)
        out[record.name] = (digest.decode(), record)
    return out


def add_key(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from protocol.api_keys import ApiKeyRecord, KeyLimits, key_hash, new_key

    try:
        limits = KeyLimits(max_concurrent=args.max_concurrent, requests_per_minute=args.requests_per_minute,
                           tokens_per_minute=args.tokens_per_minute)  # fmt: skip
        record = ApiKeyRecord(name=args.name, limits=limits, created_at=time.time())
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        print(f"tokenwire keys add: {problems}", file=sys.stderr)
        return 2
    r, keys = _store(args)
    if args.name in _records(r, keys):
        print(f"tokenwire keys add: a key named {args.name!r} exists; revoke it first", file=sys.stderr)
        return 1
    key = new_key()
    r.hset(keys.api_keys(), key_hash(key), record.model_dump_json())
    print(key)
    return 0


def revoke_key(args: argparse.Namespace) -> int:
    r, keys = _store(args)
    found = _records(r, keys).get(args.name)
    if found is None:
        print(f"tokenwire keys revoke: no key named {args.name!r}", file=sys.stderr)
        return 1
    r.hdel(keys.api_keys(), found[0])
    print(f"revoked {args.name}")
    return 0


def list_keys(args: argparse.Namespace) -> int:
    r, keys = _store(args)
    for name, (_, record) in sorted(_records(r, keys).items()):
        print(json.dumps({"name": name, **record.model_dump(exclude={"name"})}))
    return 0


def key_usage(args: argparse.Namespace) -> int:
    r, keys = _store(args)
    names = [args.name] if args.name else sorted(_records(r, keys))
    for name in names:
        raw: dict[bytes, bytes] = r.hgetall(keys.api_key_usage(name))  # type: ignore[assignment]
        counts = {k.decode(): int(v) for k, v in raw.items()}
        print(json.dumps({"name": name, "requests": counts.get("requests", 0),
                          "prompt_tokens": counts.get("prompt_tokens", 0),
                          "completion_tokens": counts.get("completion_tokens", 0)}))  # fmt: skip
    return 0
