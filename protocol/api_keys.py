"""An API key as gateways and `tokenwire keys` store it: never the key, only its
SHA-256, beside the name and limits it carries.

The keys are random (256 bits, `new_key`), so a plain SHA-256 cannot be reversed
or searched; a slow password hash would only slow every request's check.
"""

from __future__ import annotations

import hashlib
import re
import secrets

from pydantic import BaseModel, ConfigDict, Field

KEY_PREFIX = "tw-"
API_KEY_ENV = "TOKENWIRE_API_KEY"  # a client's key, where it is given no other
_NAME_RE = r"[A-Za-z0-9_.\-]{1,64}"


class KeyLimits(BaseModel):
    """Per-key limits, each over all gateways; None: unlimited."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_concurrent: int | None = Field(default=None, ge=1)
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)


class ApiKeyRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=_NAME_RE)  # what logs, usage and /metrics show (never the key)
    limits: KeyLimits = KeyLimits()
    created_at: float = 0.0


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def valid_name(name: str) -> bool:
    return re.fullmatch(_NAME_RE, name) is not None
