"""Secrets kept out of argv and logs: the Redis URL may come from the environment
(TOKENWIRE_REDIS_URL) and its password from a file (--redis-password-file), so `ps`
shows neither; any URL a log line shows has its password replaced.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

REDIS_URL_ENV = "TOKENWIRE_REDIS_URL"


def add_redis_password_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-password-file", default=None, metavar="PATH",
        help=f"read the Redis password from this file (keep it out of argv; or set {REDIS_URL_ENV})",
    )  # fmt: skip


def redis_url(url: str, default: str, password_file: str | None) -> str:
    """The Redis URL to use: `url` as given, or TOKENWIRE_REDIS_URL where `url` was
    left at its default; with the password read from `password_file` if there is one."""
    if url == default:
        url = os.environ.get(REDIS_URL_ENV) or url
    if password_file is None:
        return url
    password = Path(password_file).read_text().strip()
    if not password:
        raise ValueError(f"{password_file}: no password in it")
    parts = urlsplit(url)
    user = quote(parts.username or "", safe="")
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def redact(url: str) -> str:
    """`url` fit for a log: its password, if any, shown as ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
