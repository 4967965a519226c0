"""A gateway with its HTTP front over one worker, for the HTTP tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.procs import Stack, free_port, stack


@contextmanager
def http_service(model: Path, redis_url: str, log_dir: Path) -> Iterator[Stack]:
    """One worker of `model` and a gateway with its HTTP front, whose base URL is `http_url`."""
    port = free_port()
    with stack(model, redis_url, log_dir, workers=0, gateways=0) as s:
        s.worker()
        s.gateway("--http-port", str(port))
        s.gateways[0].wait_workers(1)
        s.http_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
        yield s
