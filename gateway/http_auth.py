"""ASGI middleware of the HTTP front: `Authorization: Bearer KEY` on every path
but the open ones (by default /health and /metrics), answered as OpenAI answers
a missing or wrong key (401); then the key's limits (gateway/key_limits.py,
checked and counted in memory: no Redis round trip on a request's path),
answered as OpenAI answers a rate limit (429, `retry-after`, `x-ratelimit-*`).
The handlers report the tokens they served in the request's `usage`."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api_keys import ApiKeys
from gateway.key_limits import KeyLimiter


@dataclass(slots=True)
class Usage:
    """The tokens one HTTP request was served, set by its handler."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


def usage_of(scope: Scope) -> Usage:
    """The request's Usage to fill in (a spare one where no key is checked)."""
    usage = scope.get("state", {}).get("usage")
    return usage if isinstance(usage, Usage) else Usage()


def error(message: str, kind: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


async def send_json(send: Send, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    data = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
            *((k.encode(), v.encode()) for k, v in headers.items())]  # fmt: skip
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data})


def bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, keys: ApiKeys, open_paths: frozenset[str], limits: KeyLimiter) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        token = bearer(scope)
        record = self.keys.check(token)
        if record is None:
            why = ("You didn't provide an API key. Provide it in the Authorization header (Bearer KEY)."
                   if token is None else "Incorrect API key provided.")  # fmt: skip
            body = error(why, "invalid_request_error", "invalid_api_key")
            return await send_json(send, 401, body, {"www-authenticate": "Bearer"})
        lease = uuid.uuid4().hex
        refusal = self.limits.admit(record, lease)
        if refusal is not None:
            body = error(refusal.message, "requests", "rate_limit_exceeded")
            return await send_json(send, 429, body, refusal.headers)
        usage = Usage()
        scope.setdefault("state", {}).update(api_key=record, usage=usage)
        try:
            await self.app(scope, receive, send)
        finally:
            self.limits.done(record, lease, usage.prompt_tokens, usage.completion_tokens)
