"""The API keys a gateway accepts, from a file, an environment variable and Redis.

A check is one dictionary lookup by the key's SHA-256 (the hot path never waits
on Redis). The keys stored in Redis (protocol/api_keys.py, `tokenwire keys`) are
read again every `refresh_s` on a thread of their own: a key added there is
accepted, and one revoked refused, by every gateway within that time.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import threading
from pathlib import Path

import redis
from pydantic import ValidationError

import protocol
from protocol.api_keys import API_KEY_ENV, ApiKeyRecord, key_hash

log = logging.getLogger(__name__)

API_KEYS_ENV = "TOKENWIRE_API_KEYS"  # comma-separated keys
REFRESH_S = 2.0


class ApiKeyError(ValueError):
    """A key file or setting that cannot be used; the text names it."""


def add_api_key_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="API keys clients must present, one a line (`KEY` or `NAME KEY`); "
                   f"keys also come from ${API_KEYS_ENV} (comma-separated) and, with --api-keys-redis, Redis")
    p.add_argument("--api-keys-redis", action="store_true",
                   help="accept the keys `tokenwire keys add` stores (hashed) in Redis; revoked ones stop "
                   f"working within {REFRESH_S:g} s")
    p.add_argument("--auth-open-paths", default="/health,/metrics", metavar="PATHS",
                   help="HTTP paths served without a key (comma-separated; every /v1 path needs one)")  # fmt: skip


def read_key_file(path: Path) -> dict[str, ApiKeyRecord]:
    """Key hash -> record, from lines `KEY` or `NAME KEY` (# starts a comment)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ApiKeyError(f"{path}: cannot read API keys: {e.strerror}") from None
    out: dict[str, ApiKeyRecord] = {}
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise ApiKeyError(f"{path}:{number}: a line is KEY or NAME KEY")
        name, key = (words[0], words[1]) if len(words) == 2 else (f"{path.stem}-{number}", words[0])
        try:
            out[key_hash(key)] = ApiKeyRecord(name=name)
        except ValidationError:
            raise ApiKeyError(f"{path}:{number}: a key's name is 1-64 of [A-Za-z0-9_.-]") from None
    return out


def env_keys(value: str) -> dict[str, ApiKeyRecord]:
    keys = [k.strip() for k in value.split(",") if k.strip()]
    return {key_hash(k): ApiKeyRecord(name=f"env-{i}") for i, k in enumerate(keys, 1)}


class ApiKeys:
    """The accepted keys: fixed ones (file, environment) and Redis's, refreshed."""

    def __init__(self, fixed: dict[str, ApiKeyRecord], redis_url: str | None, keys: protocol.Keys,
                 refresh_s: float = REFRESH_S) -> None:  # fmt: skip
        self._fixed = fixed
        self._redis_url = redis_url
        self._keys = keys
        self._refresh_s = refresh_s
        self._stored: dict[str, ApiKeyRecord] = {}  # replaced whole by the refresh thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, redis_url: str, keys: protocol.Keys) -> ApiKeys | None:
        """The keys the options and environment give; None where none is configured (keys off)."""
        fixed = read_key_file(Path(args.api_keys_file)) if args.api_keys_file else {}
        fixed.update(env_keys(os.environ.get(API_KEYS_ENV, "")))
        if not fixed and not args.api_keys_redis:
            return None
        return cls(fixed, redis_url if args.api_keys_redis else None, keys)

    def check(self, key: str | None) -> ApiKeyRecord | None:
        """The record of an accepted key; None for no key or one not accepted."""
        if not key:
            return None
        digest = key_hash(key)
        return self._fixed.get(digest) or self._stored.get(digest)

    def start(self) -> None:
        if self._redis_url is not None:
            self._refresh()  # keys stored before the gateway started are accepted from its first request
            self._thread = threading.Thread(target=self._poll, name="gateway-api-keys", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _poll(self) -> None:
        while not self._stop.wait(self._refresh_s):
            self._refresh()

    def _refresh(self) -> None:
        assert self._redis_url is not None
        try:
            with redis.Redis.from_url(self._redis_url, socket_timeout=self._refresh_s) as r:
                raw: dict[bytes, bytes] = r.hgetall(self._keys.api_keys())
        except redis.RedisError as e:
            # Keep the last set: a Redis outage must not lock every client out (revocations wait for it).
            log.warning("cannot refresh API keys from Redis: %s", e)
            return
        stored = {}
        for digest, blob in raw.items():
            try:
                stored[digest.decode()] = ApiKeyRecord.model_validate_json(blob)
            except (ValidationError, UnicodeDecodeError):
                log.warning("API key record %s in Redis is not valid; ignored", digest[:12])
        self._stored = stored


class HelloKeys:
    """The keys ZeroMQ clients give in their Hello (API keys on, CURVE off). The
    gateway's HTTP front is one such client, with a key of its own (it checks its
    clients' keys itself)."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys
        self.own_key = secrets.token_urlsafe(24)

    def record(self, msg: protocol.Hello) -> ApiKeyRecord | None:
        """The record of the accepted key in `msg` whose limits apply; None for the HTTP front's own."""
        key = msg.api_key
        return None if key is None or secrets.compare_digest(key, self.own_key) else self.keys.check(key)

    def refusal(self, msg: protocol.Message) -> protocol.ErrorReply | None:
        """None where `msg` is a Hello with an accepted key; else the answer to refuse it with."""
        key = msg.api_key if isinstance(msg, protocol.Hello) else None
        if key is not None and (secrets.compare_digest(key, self.own_key) or self.keys.check(key) is not None):
            return None
        why = "an API key that is not accepted" if key else "no API key"
        text = f"this gateway needs an API key in the client's Hello (api_key=, ${API_KEY_ENV}); got {why}"
        return protocol.ErrorReply(code=protocol.ErrorCode.UNAUTHORIZED, message=text,
                                   request_id=getattr(msg, "request_id", None))  # fmt: skip
