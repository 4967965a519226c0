"""Stored Responses API responses in Redis, each with the conversation it ends, under
a TTL: any gateway can answer GET /v1/responses/{id} or continue the conversation
(`previous_response_id`). Blocking calls: the HTTP front runs them on a thread."""

from __future__ import annotations

import json
from typing import Any

import redis

from protocol.keys import RESPONSE_TTL_S, Keys


class ResponseStore:
    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: int = RESPONSE_TTL_S) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s  # how long a stored response (and its conversation) is kept

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        blob = json.dumps({"response": response, "conversation": conversation}, separators=(",", ":"))
        self.redis.set(self.keys.response(response["id"]), blob, ex=self.ttl_s)

    def get(self, response_id: str) -> dict[str, Any] | None:
        """{"response": ..., "conversation": [...]}, or None if there is none (or it expired)."""
        blob = self.redis.get(self.keys.response(response_id))
        return None if blob is None else dict(json.loads(blob))

    def delete(self, response_id: str) -> bool:
        return bool(self.redis.delete(self.keys.response(response_id)))
