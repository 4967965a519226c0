"""Redis secrets from a file or the environment, never shown in logs."""

from __future__ import annotations

import redis

from ops.secrets import REDIS_URL_ENV, redact, redis_url

DEFAULT = "redis://127.0.0.1:6379/0"


def test_the_password_comes_from_a_file(tmp_path):
    secret = tmp_path / "password"
    secret.write_text("s3cr:t/@x\n")
    url = redis_url("redis://10.0.0.5:6380/2", DEFAULT, str(secret))
    kwargs = redis.connection.parse_url(url)
    assert kwargs["password"] == "s3cr:t/@x" and kwargs["host"] == "10.0.0.5" and kwargs["db"] == 2
    assert "s3cr" not in redact(url) and redact(url) == "redis://:***@10.0.0.5:6380/2"


def test_the_environment_gives_the_url_where_none_was_given(monkeypatch):
    monkeypatch.setenv(REDIS_URL_ENV, "redis://user:pw@10.0.0.7:6379/0")
    assert redis_url(DEFAULT, DEFAULT, None) == "redis://user:pw@10.0.0.7:6379/0"
    assert redis_url("redis://other:6379/0", DEFAULT, None) == "redis://other:6379/0"
    assert redact("redis://user:pw@10.0.0.7:6379/0") == "redis://user:***@10.0.0.7:6379/0"
    assert redact(DEFAULT) == DEFAULT
